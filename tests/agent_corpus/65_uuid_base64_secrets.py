# expect: ok
# stdout: decoded: hello world
import base64
import secrets
import uuid

run_id = uuid.uuid4()
token = secrets.token_hex(8)
encoded = base64.b64encode(b"hello world").decode()
print("decoded:", base64.b64decode(encoded).decode())
print(len(str(run_id)), len(token))
