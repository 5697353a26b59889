# expect: ok
# stdout: finished within the alarm
import signal


def handler(signum, frame):
    raise TimeoutError("took too long")


signal.signal(signal.SIGALRM, handler)
signal.alarm(5)
total = sum(range(100000))
signal.alarm(0)
print("finished within the alarm")
