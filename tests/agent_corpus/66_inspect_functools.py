# expect: ok
# stdout: calls: 3
import functools
import inspect


def count_calls(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        wrapper.calls += 1
        return fn(*args, **kwargs)

    wrapper.calls = 0
    return wrapper


@count_calls
def greet(name: str, punctuation: str = "!") -> str:
    return f"Hello, {name}{punctuation}"


for n in ["a", "b", "c"]:
    greet(n)
print("calls:", greet.calls)
print(inspect.signature(greet))
