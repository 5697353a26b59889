# expect: ok
# stdout: archive members: ['report.txt', 'summary.json']
import json
import zipfile

with open("report.txt", "w") as f:
    f.write("quarterly report\n")
with open("summary.json", "w") as f:
    json.dump({"ok": True}, f)
with zipfile.ZipFile("bundle.zip", "w", zipfile.ZIP_DEFLATED) as z:
    z.write("report.txt")
    z.write("summary.json")
with zipfile.ZipFile("bundle.zip") as z:
    print("archive members:", sorted(z.namelist()))
