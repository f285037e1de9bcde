"""Setup happens once, before the first answer, and is reported apart: on a machine whose native build cache is
empty, a fresh process builds the native CPU steps, packs the weights and warms up while the pipeline is built, so
its first answer costs about what its second does (the build is `setup_ms`, never a stage)."""

import json
import os
import subprocess
import sys

import pytest

from litevlm.model import native

SCRIPT = """
import json
from litevlm import Pipeline
from litevlm.data.synthetic import make_frame, render_views
pipe = Pipeline.from_pretrained("drive-tiny", select_views=True, select_tokens=0.5, speculative=True)
images = render_views(make_frame(3, 1), size=(400, 225))
q = "Is there a car in front of the ego vehicle?"
first, second = pipe.answer(q, images), pipe.answer(q, images)
print(json.dumps({"setup_ms": pipe.setup_ms, "backend": pipe.backend.name, "first": first.timings_ms["total"],
                  "second": second.timings_ms["total"], "same": first.tokens == second.tokens}))
"""


@pytest.mark.slow
@pytest.mark.once
def test_the_first_answer_on_an_empty_build_cache_costs_about_the_second(tmp_path):
    if not native.enabled() or native.ops() is None:
        pytest.skip(f"the native CPU steps are unavailable here ({native.error()})")
    env = dict(os.environ, LITEVLM_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["backend"] == "native" and got["same"]
    assert "building the native CPU steps" in out.stderr  # the cache was empty: this process built them
    assert got["setup_ms"] > got["first"]  # the build went to setup, not into the first answer's stages
    # The first answer no longer pays for the build (35 s before): within 2x of the second, with 2 ms for the
    # timer's noise on answers of ~15 ms.
    assert got["first"] <= 2 * got["second"] + 2.0, got
