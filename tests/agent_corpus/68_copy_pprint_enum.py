# expect: ok
# stdout: Color.GREEN
import copy
import pprint
from enum import Enum


class Color(Enum):
    RED = 1
    GREEN = 2


config = {"colors": [Color.RED], "nested": {"a": [1, 2, 3]}}
clone = copy.deepcopy(config)
clone["colors"].append(Color.GREEN)
pprint.pprint(config)
print(clone["colors"][-1])
