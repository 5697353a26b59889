# expect: ok
# stdout: widget 12
# stdout: total items: 17
import sqlite3

conn = sqlite3.connect("inventory.db")
cur = conn.cursor()
cur.execute("CREATE TABLE IF NOT EXISTS items (name TEXT PRIMARY KEY, qty INTEGER)")
cur.executemany("INSERT INTO items VALUES (?, ?)", [("widget", 12), ("gadget", 5)])
conn.commit()
for name, qty in cur.execute("SELECT name, qty FROM items WHERE qty > 10"):
    print(name, qty)
(total,) = cur.execute("SELECT SUM(qty) FROM items").fetchone()
print(f"total items: {total}")
conn.close()
