# expect: ok
# stdout: Alice 31
import json

people = [{"name": "Alice", "age": 30}, {"name": "Bob", "age": 25}]
with open("people.json", "w") as f:
    json.dump(people, f, indent=2)

with open("people.json") as f:
    data = json.load(f)
data[0]["age"] += 1
print(data[0]["name"], data[0]["age"])
