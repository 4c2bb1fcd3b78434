"""The layer order of LAYERS holds for every #include of the tree, and the check that says so can
fail: on a made-up tree with an include that runs upward it names the file, the line and both
layers."""
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.environ.get("TESSEL_ROOT", os.path.join(HERE, "..", ".."))
CHECK = os.path.join(HERE, "check_layers.py")


def check(root):
    r = subprocess.run([sys.executable, CHECK, root], capture_output=True, text=True)
    return r.returncode, r.stdout


class Layers(unittest.TestCase):
    def test_tree_keeps_the_order(self):
        rc, out = check(ROOT)
        self.assertEqual(rc, 0, out)
        self.assertIn("0 include(s) against the layer order", out)

    def test_upward_include_is_named(self):
        with tempfile.TemporaryDirectory() as d:
            def write(path, text):
                os.makedirs(os.path.dirname(os.path.join(d, path)), exist_ok=True)
                with open(os.path.join(d, path), "w") as f:
                    f.write(text)
            write("LAYERS", "top: run\nmid: models\nlow: plan  # comment\n")
            write("plan/config.h", "#pragma once\n")
            write("models/layers.h", '#pragma once\n#include "plan/config.h"\n')
            write("run/train.cpp", '#include "models/layers.h"\n#include "plan/config.h"\n')
            rc, out = check(d)
            self.assertEqual(rc, 0, out)
            write("models/registry.cpp", '#include <map>\n\n#include "run/train.h"\n')
            write("stray/x.cpp", "int x;\n")
            rc, out = check(d)
            self.assertEqual(rc, 1, out)
            self.assertIn("models/registry.cpp:3: includes run/train.h: models/ (mid) may not "
                          "include run/ (top), a layer above it", out)
            self.assertIn("stray/x.cpp: folder stray/ is in no layer of LAYERS", out)
            self.assertIn("2 include(s) against the layer order (top > mid > low)", out)


if __name__ == "__main__":
    unittest.main()
