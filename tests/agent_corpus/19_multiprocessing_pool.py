# expect: ok
# stdout: [0, 2, 4, 6, 8]
import multiprocessing as mp


def double(n):
    return n * 2


if __name__ == "__main__":
    with mp.Pool(2) as pool:
        print(pool.map(double, range(5)))
