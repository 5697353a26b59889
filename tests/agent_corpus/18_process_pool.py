# expect: ok
# stdout: [1, 8, 27, 64]
from concurrent.futures import ProcessPoolExecutor


def cube(x):
    return x ** 3


if __name__ == "__main__":
    with ProcessPoolExecutor(max_workers=2) as ex:
        print(list(ex.map(cube, [1, 2, 3, 4])))
