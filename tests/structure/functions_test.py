"""Functions read as their steps: none in the engine's folders (check_functions.FOLDERS) is over
60 lines, and the check that says so finds a long one on a made-up tree."""
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.environ.get("TESSEL_ROOT", os.path.join(HERE, "..", ".."))
CHECK = os.path.join(HERE, "check_functions.py")


def check(root):
    r = subprocess.run([sys.executable, CHECK, root], capture_output=True, text=True)
    return r.returncode, r.stdout


class Functions(unittest.TestCase):
    def test_no_function_over_60_lines(self):
        rc, out = check(ROOT)
        self.assertEqual(rc, 0, out)
        self.assertIn("0 function(s) over 60 lines", out)

    def test_long_function_is_named(self):
        body = "".join(f"  x += {i};  // {{ a brace in a comment\n" for i in range(61))
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "run"))
            with open(os.path.join(d, "run", "a.cpp"), "w") as f:
                f.write('namespace t {\nconst char* s = "}";\n'
                        "int short_one(int x) {\n  if (x) {\n    return 1;\n  }\n  return 0;\n}\n"
                        "int long_one(int x) {\n" + body + "  return x;\n}\n}  // namespace t\n")
            rc, out = check(d)
            self.assertEqual(rc, 1, out)
            self.assertIn("run/a.cpp:9: 64 lines: int long_one(int x)", out)
            self.assertNotIn("short_one", out)
            self.assertIn("1 function(s) over 60 lines", out)


if __name__ == "__main__":
    unittest.main()
