"""The code's structure, held for the whole tree: the layer order of LAYERS for every #include
(check_layers.py), namespaces that follow folders (check_namespaces.py), decisions read through their owners
(check_owners.py), and no function over 60 lines in the engine's folders (check_functions.py).
Each check is also shown to fail, naming what is wrong, on a made-up tree."""
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.environ.get("TESSEL_ROOT", os.path.join(HERE, "..", ".."))


def tree_writer(root):
    """write(path, text) under a made-up tree at `root`, making its folders."""
    def write(path, text):
        os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
        with open(os.path.join(root, path), "w") as f:
            f.write(text)
    return write


def check(script, root):
    r = subprocess.run([sys.executable, os.path.join(HERE, script), root], capture_output=True, text=True)
    return r.returncode, r.stdout


class Layers(unittest.TestCase):
    def test_tree_keeps_the_order(self):
        rc, out = check("check_layers.py", ROOT)
        self.assertEqual(rc, 0, out)
        self.assertIn("0 include(s) against the layer order", out)

    def test_upward_include_is_named(self):
        with tempfile.TemporaryDirectory() as d:
            write = tree_writer(d)
            write("LAYERS", "top: run\nmid: models\nlow: plan  # comment\n")
            write("plan/config.h", "#pragma once\n")
            write("models/layers.h", '#pragma once\n#include "plan/config.h"\n')
            write("run/train.cpp", '#include "models/layers.h"\n#include "plan/config.h"\n')
            rc, out = check("check_layers.py", d)
            self.assertEqual(rc, 0, out)
            write("models/registry.cpp", '#include <map>\n\n#include "run/train.h"\n')
            write("stray/x.cpp", "int x;\n")
            rc, out = check("check_layers.py", d)
            self.assertEqual(rc, 1, out)
            self.assertIn("models/registry.cpp:3: includes run/train.h: models/ (mid) may not "
                          "include run/ (top), a layer above it", out)
            self.assertIn("stray/x.cpp: folder stray/ is in no layer of LAYERS", out)
            self.assertIn("2 include(s) against the layer order (top > mid > low)", out)

    def test_circle_between_top_level_folders_is_named(self):
        with tempfile.TemporaryDirectory() as d:
            write = tree_writer(d)
            # Every include runs downward, yet engine/ and models/ include each other.
            write("LAYERS", "top: engine/run\nmid: models\nlow: engine/io\n")
            write("engine/io/file.h", "#pragma once\n")
            write("models/layers.h", '#pragma once\n#include "engine/io/file.h"\n')
            write("engine/run/train.cpp", '#include "models/layers.h"\n')
            rc, out = check("check_layers.py", d)
            self.assertEqual(rc, 1, out)
            self.assertIn("models/layers.h:2: includes engine/io/file.h: top-level folders models/ and engine/ "
                          "include each other (a circle)", out)
            self.assertIn("engine/run/train.cpp:1: includes models/layers.h: top-level folders engine/ and "
                          "models/ include each other (a circle)", out)
            self.assertIn("2 include(s) against the layer order (top > mid > low)", out)



class Choices(unittest.TestCase):
    def test_no_typed_choice_compared_with_a_string(self):
        rc, out = check("check_choices.py", ROOT)
        self.assertEqual(rc, 0, out)
        self.assertIn("0 comparison(s) of a typed plan choice with a string outside core/plan/", out)

    def test_comparison_is_named(self):
        with tempfile.TemporaryDirectory() as d:
            write = tree_writer(d)
            write("core/plan/config.h", "struct P {\n  Choice<PipelineSchedule> pipeline_schedule;\n"
                                        "  Choice<RouterScore> router_score;\n  std::string arch;\n};\n")
            write("core/plan/config_fields.cpp",
                  'add("parallel.pipeline.schedule", &c.parallel.pipeline_schedule, S("1f1b"), "x");\n'
                  'add("model.moe.router.score", &c.model.moe.router_score, S("softmax"), "x");\n'
                  'add("model.arch", &c.model.arch, S("gpt2"), "Architecture; of a model.").one_of({"gpt2"});\n')
            write("core/plan/rules.cpp", 'bool a = c.parallel.pipeline_schedule == "zbv";  // inside plan/\n')
            write("engine/run/train.cpp", 'bool ok = c.parallel.pipeline_schedule == PipelineSchedule::kZbv;\n'
                                          'bool bad = c_.parallel.pipeline_schedule != "zbv";\n'
                                          'bool arch = c.model.arch == "llama";\n')
            # Carried under the key's last part into a part's options, or read from c10d.
            write("models/moe.cpp", 'auto p = m_.score == "sigmoid" ? a : b;\n'
                                    'auto q = "softmax" != score;\n'
                                    'bool scores = m_.scores == "x";  // another name\n')
            write("parallel/comm.cpp", 'bool g = b.getBackendName() == "gloo";\n')
            rc, out = check("check_choices.py", d)
            self.assertEqual(rc, 1, out)
            self.assertIn('engine/run/train.cpp:2: plan choice pipeline_schedule compared with a string', out)
            self.assertIn('models/moe.cpp:1: plan choice score compared with a string', out)
            self.assertIn('models/moe.cpp:2: plan choice score compared with a string', out)
            self.assertIn('parallel/comm.cpp:1: plan choice getBackendName() compared with a string', out)
            self.assertNotIn("rules.cpp", out)
            self.assertNotIn("moe.cpp:3", out)
            self.assertIn("4 comparison(s) of a typed plan choice with a string outside core/plan/ (typed: "
                          "pipeline_schedule, router_score; enumerated keys still held as strings: 1: model.arch)",
                          out)


class Owners(unittest.TestCase):
    def test_decisions_are_read_through_their_owners(self):
        rc, out = check("check_owners.py", ROOT)
        self.assertEqual(rc, 0, out)
        self.assertIn("0 decision(s) read outside their owners", out)

    def test_a_decision_outside_its_owner_is_named(self):
        with tempfile.TemporaryDirectory() as d:
            write = tree_writer(d)
            write("models/registry.cpp", "case plan::ModelArch::kLlama: return kLlama;\n")
            write("core/plan/rules.cpp", "bool g = a == ModelArch::kGpt2;\n")
            write("engine/planner/memory.cpp", "const double mats = m.arch == plan::ModelArch::kLlama ? 3 : 2;\n"
                                               "// m.arch == plan::ModelArch::kLlama in a comment\n")
            rc, out = check("check_owners.py", d)
            self.assertEqual(rc, 1, out)
            self.assertIn("engine/planner/memory.cpp:1: an architecture's name outside its owners", out)
            self.assertNotIn("memory.cpp:2", out)
            self.assertNotIn("registry.cpp:", out)
            self.assertNotIn("rules.cpp:", out)
            self.assertIn("1 decision(s) read outside their owners", out)

    def test_a_zero_stage_compared_outside_its_owners_is_named(self):
        with tempfile.TemporaryDirectory() as d:
            write = tree_writer(d)
            write("parallel/dp/grad_sync.cpp", "if (zero == 3) return units;\n")
            write("core/plan/layout.h", "return {stage >= 1, stage >= 2, c.parallel.zero >= 3};\n")
            write("core/optim/optim.cpp", "if (layout_.zero() < 3) keep();\n"
                                          "const bool z = c.parallel.zero;\n"
                                          "if (b.zero >= 2) scatter();\n"
                                          "if (2 <= b.zero) scatter();\n"
                                          "if (b.sharding.weights) gather();\n"
                                          'fail("parallel.zero must be 0-3");\n'
                                          "// zero == 3 in a comment\n")
            rc, out = check("check_owners.py", d)
            self.assertEqual(rc, 1, out)
            for n in (1, 2, 3, 4):
                self.assertIn(f"core/optim/optim.cpp:{n}: the ZeRO stage outside its owners", out)
            for n in (5, 6, 7):
                self.assertNotIn(f"optim.cpp:{n}:", out)
            self.assertNotIn("grad_sync.cpp:", out)
            self.assertNotIn("layout.h:", out)
            self.assertIn("4 decision(s) read outside their owners", out)


class Namespaces(unittest.TestCase):
    def test_namespaces_follow_folders(self):
        rc, out = check("check_namespaces.py", ROOT)
        self.assertEqual(rc, 0, out)
        self.assertIn("0 namespace(s) against their folder", out)

    def test_stray_namespace_is_named(self):
        with tempfile.TemporaryDirectory() as d:
            write = tree_writer(d)
            write("engine/run/train.h", "namespace tessel::parallel::dp {\nclass GradSync;\n}  // fwd\n"
                                        "namespace tessel::run {\nint a;\n}  // namespace tessel::run\n")
            write("engine/run/bad.cpp", "namespace tessel {\nint b;\n}  // namespace tessel\n")
            write("core/kernels/k.cpp", "namespace tessel::kernels::cpu {\nint c;\n}\n")
            write("parallel/pp/s.cpp", "namespace tessel::parallel {\nint d;\n}\n")
            rc, out = check("check_namespaces.py", d)
            self.assertEqual(rc, 1, out)
            self.assertIn("engine/run/bad.cpp:1: opens namespace tessel; its folder's is tessel::run", out)
            self.assertIn("parallel/pp/s.cpp:1: opens namespace tessel::parallel; its folder's is "
                          "tessel::parallel::pp", out)
            self.assertNotIn("train.h", out)
            self.assertNotIn("k.cpp", out)
            self.assertIn("2 namespace(s) against their folder in 4 files", out)


class Functions(unittest.TestCase):
    def test_no_function_over_60_lines(self):
        rc, out = check("check_functions.py", ROOT)
        self.assertEqual(rc, 0, out)
        self.assertIn("0 function(s) over 60 lines", out)

    def test_long_function_is_named(self):
        body = "".join(f"  x += {i};  // {{ a brace in a comment\n" for i in range(61))
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "engine", "run"))
            with open(os.path.join(d, "engine", "run", "a.cpp"), "w") as f:
                f.write('namespace t {\nconst char* s = "}";\n'
                        "int short_one(int x) {\n  if (x) {\n    return 1;\n  }\n  return 0;\n}\n"
                        "int long_one(int x) {\n" + body + "  return x;\n}\n}  // namespace t\n")
            rc, out = check("check_functions.py", d)
            self.assertEqual(rc, 1, out)
            self.assertIn("engine/run/a.cpp:9: 64 lines: int long_one(int x)", out)
            self.assertNotIn("short_one", out)
            self.assertIn("1 function(s) over 60 lines", out)



if __name__ == "__main__":
    unittest.main()
