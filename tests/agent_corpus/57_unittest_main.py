# expect: ok
# stderr: OK
import unittest


def slugify(s):
    return "-".join(s.lower().split())


class SlugTests(unittest.TestCase):
    def test_basic(self):
        self.assertEqual(slugify("Hello World"), "hello-world")

    def test_spaces(self):
        self.assertEqual(slugify("  a   b "), "a-b")


if __name__ == "__main__":
    unittest.main()
