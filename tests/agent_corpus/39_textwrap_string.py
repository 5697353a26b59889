# expect: ok
# stdout: Title Case Words Here
import string
import textwrap

s = "title case words here"
print(string.capwords(s))
print(textwrap.fill("lorem ipsum dolor sit amet " * 5, width=40))
