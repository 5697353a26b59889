# expect: ok
# stdout: [('bob', 2), ('alice', 1)]
import sqlite3

db = sqlite3.connect(":memory:")
db.execute("create table events(user text, kind text)")
db.executemany("insert into events values (?, ?)", [("alice", "login"), ("bob", "login"), ("bob", "logout")])
rows = db.execute("select user, count(*) c from events group by user order by c desc").fetchall()
print(rows)
