# expect: ok
# stdout: all checks passed
def check():
    assert 2 + 2 == 4
    print("all checks passed")
    raise SystemExit


check()
