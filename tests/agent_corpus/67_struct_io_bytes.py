# expect: ok
# stdout: header: (1, 3, 2.5)
import io
import struct

buf = io.BytesIO()
buf.write(struct.pack("<HIf", 1, 3, 2.5))
buf.seek(0)
print("header:", struct.unpack("<HIf", buf.read()))
