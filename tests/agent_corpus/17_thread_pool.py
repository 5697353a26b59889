# expect: ok
# stdout: fetched 5 pages
from concurrent.futures import ThreadPoolExecutor, as_completed
import time


def fetch(page):
    time.sleep(0.01)
    return {"page": page, "items": list(range(page))}


with ThreadPoolExecutor(max_workers=4) as pool:
    futures = [pool.submit(fetch, p) for p in range(1, 6)]
    pages = [f.result() for f in as_completed(futures)]
print(f"fetched {len(pages)} pages")
