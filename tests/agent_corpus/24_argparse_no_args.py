# expect: ok
# stdout: limit=10 verbose=False
import argparse


def main():
    parser = argparse.ArgumentParser(description="Process some data.")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    print(f"limit={args.limit} verbose={args.verbose}")


if __name__ == "__main__":
    main()
