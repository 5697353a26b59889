# expect: ok
# stdout: log lines: 2
import logging

logging.basicConfig(filename="app.log", level=logging.DEBUG, format="%(asctime)s %(levelname)s %(message)s")
logging.debug("debug message")
logging.error("something failed")
logging.shutdown()
with open("app.log") as f:
    print("log lines:", len(f.readlines()))
