"""`zclaw eval --video`: real MuJoCo offscreen rendering (OSMesa unless MUJOCO_GL is set), decoded back."""
from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
from support.procs import ZCLAW
import torch

from zclaw import config as config_mod
from zclaw.envs.gym_backend import GymBatchedEnv
from zclaw.learner import checkpoint as ckpt
from zclaw.policy.networks import OptionPolicy
from zclaw.policy.weights import policy_config
from zclaw.tools.video import PALETTE, STUDENT_COLOUR, annotate, default_gl, gl_probe


@pytest.fixture(scope="module")
def gl() -> None:
    err = gl_probe("Reacher-v5")
    if err:
        pytest.skip(f"no GL backend renders here (tried {default_gl() or 'MUJOCO_GL as set'}): {err}; "
                    "install libosmesa6 (apt-get install libosmesa6) or set MUJOCO_GL=egl on a GPU host")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh K = 3 policy for Reacher-v5 saved as a learner checkpoint (what eval reads)."""
    env = GymBatchedEnv("Reacher-v5", 1, 0, torch.device("cpu"))
    spec = env.spec
    env.close()
    cfg = config_mod.defaults()
    cfg["policy"]["options"] = 3
    torch.manual_seed(0)
    model = OptionPolicy(policy_config(cfg["policy"], spec))
    d = tmp_path_factory.mktemp("video") / "checkpoints"
    ckpt.save(d, model, None, version=7, updates=7, steps_consumed=0, config=cfg, spec=spec.to_dict())
    return d


def frames_of(path: Path) -> list:
    import imageio

    reader = imageio.get_reader(str(path))
    try:
        return [np.asarray(f) for f in reader]
    finally:
        reader.close()


def test_annotate_colours_the_border_by_option() -> None:
    frame = np.zeros((48, 64, 3), np.uint8)
    assert tuple(annotate(frame, 1)[-1, 30]) == PALETTE[1]
    assert tuple(annotate(frame, None)[30, 0]) == STUDENT_COLOUR
    assert annotate(frame, 2)[24, 32].sum() == 0  # the picture itself is untouched


def test_eval_video_mp4_decodes_to_the_frame_count(gl: None, checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "teacher.mp4"
    res = subprocess.run(ZCLAW + ["eval", str(checkpoint), "-n", "1", "--policy", "teacher",
                                  "--video", str(out), "--frames", "12", "--size", "160x120", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    frames = frames_of(out)
    assert len(frames) == 12 and frames[0].shape == (120, 160, 3)
    # every frame's bottom border is one of the option colours (lossy codec: nearest colour, small distance)
    for f in frames:
        px = f[-2, 80].astype(int)
        dist = min(np.abs(px - np.array(c)).sum() for c in PALETTE[:3])
        assert dist < 60, px
    # and the scene is rendered: the inside is not one flat colour
    assert frames[0][20:-20, 20:-20].std() > 5


def test_eval_video_gif_of_the_student(gl: None, checkpoint: Path, tmp_path: Path) -> None:
    from PIL import Image

    out = tmp_path / "student.gif"
    res = subprocess.run(ZCLAW + ["eval", str(checkpoint), "-n", "1", "--policy", "student",
                                  "--video", str(out), "--video-policy", "student", "--frames", "7",
                                  "--size", "96x64"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "video:" in res.stdout
    with Image.open(out) as img:
        assert img.size == (96, 64)
        rgb = np.asarray(img.convert("RGB"))
        assert tuple(rgb[-1, 40]) == STUDENT_COLOUR
        # Pillow folds a frame identical to the one before into it (its duration adds up), so the clip's
        # length, not its frame count, is what 7 frames at 30 fps must give (GIF delays count
        # centiseconds: 30 ms)
        total = 0
        for i in range(img.n_frames):
            img.seek(i)
            total += img.info["duration"]
        assert 1 <= img.n_frames <= 7 and total == 7 * 30


def test_eval_video_rejects_an_odd_size(checkpoint: Path, tmp_path: Path) -> None:
    res = subprocess.run(ZCLAW + ["eval", str(checkpoint), "--video", str(tmp_path / "x.mp4"),
                                  "--size", "33x20"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "--size = '33x20' is not allowed" in res.stderr
