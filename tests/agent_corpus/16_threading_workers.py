# expect: ok
# stdout: results: [0, 1, 4, 9, 16, 25, 36, 49]
import threading

results = [None] * 8
lock = threading.Lock()


def worker(i):
    value = i * i
    with lock:
        results[i] = value


threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("results:", results)
