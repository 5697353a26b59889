# expect: ok
# stdout: Sum of squares: 385
import sys


def main() -> int:
    total = sum(i * i for i in range(1, 11))
    print(f"Sum of squares: {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
