"""``accelerate.__version__`` is the Accelerate API level (1.15.0) whichever way a script reaches us.

diffusers' training examples register their save/load-state hooks only behind
``version.parse(accelerate.__version__) >= version.parse("0.16.0")``: with our own release number
there they skipped the hooks silently and their checkpoints lost the model weights. The script
below is such an example in miniature, run in a fresh interpreter under ``install_as_accelerate()``
and under ``import notebook_accel as accelerate``.
"""

from __future__ import annotations

import importlib.metadata
import json

import pytest

import notebook_accel
from notebook_accel._alias import ACCELERATE_COMPAT_VERSION
from tests.clients._subproc import last_line, run_python

_IMPORTS = {
    "alias": "import warnings, notebook_accel\nwarnings.simplefilter('ignore')\n"
    "notebook_accel.install_as_accelerate()\nimport accelerate",
    "direct": "import notebook_accel as accelerate",
}

_SCRIPT = """
import json, os, sys
import torch
from packaging import version

folder = sys.argv[1] if len(sys.argv) > 1 else {folder!r}
accelerator = accelerate.Accelerator()
torch.manual_seed(0)
unet = torch.nn.Linear(4, 3)
optimizer = torch.optim.SGD(unet.parameters(), lr=0.1)
unet, optimizer = accelerator.prepare(unet, optimizer)
hooked = []
if version.parse(accelerate.__version__) >= version.parse("0.16.0"):
    def save_model_hook(models, weights, output_dir):
        for i, model in enumerate(models):
            torch.save(accelerator.unwrap_model(model).state_dict(), os.path.join(output_dir, f"unet_{{i}}.bin"))
            weights.pop()  # saved here: save_state must not write it again
        hooked.append("save")

    def load_model_hook(models, input_dir):
        while models:
            model = models.pop()
            model.load_state_dict(torch.load(os.path.join(input_dir, "unet_0.bin")))
        hooked.append("load")

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)
saved = {{k: v.clone() for k, v in unet.state_dict().items()}}
accelerator.save_state(folder)
with torch.no_grad():
    for p in unet.parameters():
        p.add_(1.0)
accelerator.load_state(folder)
restored = all(torch.equal(v, unet.state_dict()[k]) for k, v in saved.items())
print(json.dumps({{"version": accelerate.__version__, "hooked": hooked, "files": sorted(os.listdir(folder)),
                  "restored": restored}}))
"""


@pytest.mark.parametrize("way", sorted(_IMPORTS))
def test_diffusers_style_script_saves_and_restores_weights_through_its_hooks(way: str, tmp_path) -> None:
    folder = str(tmp_path / "ckpt")
    got = json.loads(last_line(run_python(_IMPORTS[way] + _SCRIPT.format(folder=folder))))
    assert got["version"] == "1.15.0"
    assert got["hooked"] == ["save", "load"]
    assert "unet_0.bin" in got["files"]
    assert not any(name.startswith("model") for name in got["files"]), got["files"]  # the hook popped it
    assert got["restored"] is True


def test_version_is_the_api_level_and_our_release_is_kept_apart() -> None:
    assert notebook_accel.__version__ == ACCELERATE_COMPAT_VERSION == "1.15.0"
    assert notebook_accel.__notebook_accel_version__ == importlib.metadata.version("notebook-accel")
    assert notebook_accel.__notebook_accel_version__ != notebook_accel.__version__
