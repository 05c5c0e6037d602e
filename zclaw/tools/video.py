"""``zclaw eval --video out.mp4``: render the policy with MuJoCo offscreen rendering, headless.

MuJoCo picks its OpenGL backend from ``MUJOCO_GL`` when it is first imported, so the command sets
``MUJOCO_GL=osmesa`` and ``PYOPENGL_PLATFORM=osmesa`` (software rendering: Debian/Ubuntu package
``libosmesa6``) before anything imports MuJoCo, unless the user set ``MUJOCO_GL`` (``egl`` on a machine
with a GPU driver, ``glfw`` with a display). :func:`gl_probe` tells whether a backend renders, in a
child process, because a failed GL initialisation cannot be undone inside one.

Frames carry the option in effect: a border in the option's colour (matplotlib's ``tab10``) and its
number in the corner; the student's frames get a grey border. MP4 goes through ffmpeg (the binary of
``imageio-ffmpeg``, or one on PATH); without ffmpeg the video is written as a GIF next to the requested
name, and the caller is told.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

#: tab10, as 0-255 RGB
PALETTE: List[Tuple[int, int, int]] = [
    (31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
    (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207),
]
STUDENT_COLOUR = (160, 160, 160)
BORDER = 6


def default_gl() -> Dict[str, str]:
    """The environment variables the command sets when the user chose no GL backend."""
    if os.environ.get("MUJOCO_GL"):
        return {}
    return {"MUJOCO_GL": "osmesa", "PYOPENGL_PLATFORM": "osmesa"}


def gl_probe(env_id: str = "Reacher-v5", extra_env: Optional[Dict[str, str]] = None,
             timeout: float = 60) -> str:
    """Render one frame of ``env_id`` in a child process; '' if it worked, else the error text."""
    code = (
        "import gymnasium as gym\n"
        f"e = gym.make({env_id!r}, render_mode='rgb_array', width=64, height=48)\n"
        "e.reset(seed=0)\nf = e.render()\nassert f is not None and f.shape == (48, 64, 3), f\ne.close()\n"
    )
    env = dict(os.environ, **(extra_env if extra_env is not None else default_gl()))
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"rendering {env_id} took more than {timeout} s"
    if out.returncode == 0:
        return ""
    return (out.stderr.strip().splitlines() or ["exit code %d" % out.returncode])[-1]


def annotate(frame: np.ndarray, option: Optional[int]) -> np.ndarray:
    """A copy of ``frame`` with the option's colour as a border and its number (student: None, grey)."""
    from PIL import Image, ImageDraw

    colour = STUDENT_COLOUR if option is None else PALETTE[option % len(PALETTE)]
    out = frame.copy()
    out[:BORDER, :] = colour
    out[-BORDER:, :] = colour
    out[:, :BORDER] = colour
    out[:, -BORDER:] = colour
    img = Image.fromarray(out)
    draw = ImageDraw.Draw(img)
    text = "student" if option is None else f"option {option}"
    draw.rectangle([BORDER, BORDER, BORDER + 7 * len(text) + 6, BORDER + 14], fill=colour)
    draw.text((BORDER + 3, BORDER + 2), text, fill=(255, 255, 255))
    return np.asarray(img)


def ffmpeg_available() -> bool:
    try:
        import imageio_ffmpeg

        imageio_ffmpeg.get_ffmpeg_exe()
        return True
    except Exception:  # the package is missing or ships no binary for this platform
        import shutil

        return shutil.which("ffmpeg") is not None


class _GifWriter:
    """The GIF fallback: frames kept in memory (a short clip), written by Pillow on close."""

    def __init__(self, path: Path, fps: int) -> None:
        self.path, self.fps = path, fps
        self.frames: List[np.ndarray] = []

    def append_data(self, frame: np.ndarray) -> None:
        self.frames.append(frame)

    def close(self) -> None:
        from PIL import Image

        if not self.frames:
            return
        imgs = [Image.fromarray(f) for f in self.frames]
        imgs[0].save(str(self.path), save_all=True, append_images=imgs[1:], duration=int(1000 / self.fps),
                     loop=0)


def record(
    model: Any, spec: Dict[str, Any], out: Path, *, frames: int = 200, who: str = "teacher", seed: int = 0,
    width: int = 320, height: int = 240, fps: int = 30,
) -> Tuple[Path, int]:
    """Render ``frames`` frames of ``who`` acting (episodes follow one another); return (path, frames)."""
    import imageio

    from ..envs.gym_backend import flat_dim, flattener, make_one
    from .evaluate import action_bounds
    from ..envs.registry import split_env_id

    prefix, name = split_env_id(spec["env_id"])
    if prefix != "gym":
        raise ValueError(f"--video renders gym: MuJoCo envs only; {spec['env_id']!r} is a {prefix}: env")
    if frames < 1:
        raise ValueError(f"--frames = {frames} is not allowed: expected >= 1")
    env = make_one(name, render_mode="rgb_array", width=width, height=height)
    flat = flattener(env.observation_space)
    row = np.zeros(flat_dim(env.observation_space), dtype=np.float32)
    low, high = action_bounds(spec)
    out = Path(out)
    if out.suffix.lower() != ".gif" and not ffmpeg_available():
        out = out.with_suffix(".gif")
    out.parent.mkdir(parents=True, exist_ok=True)
    writer: Any = _GifWriter(out, fps) if out.suffix.lower() == ".gif" else imageio.get_writer(
        str(out), fps=fps, codec="libx264", quality=7, macro_block_size=1, pixelformat="yuv420p")
    written = 0
    try:
        obs, _ = env.reset(seed=seed)
        prev = torch.zeros(1, dtype=torch.long)
        start = torch.ones(1, dtype=torch.bool)
        episode = 0
        while written < frames:
            flat(obs, row)
            x = torch.from_numpy(row.copy()).unsqueeze(0)
            with torch.no_grad():
                if who == "teacher":
                    step = model.act(x, prev, start, deterministic=True)
                    action, option = step["action"], int(step["option"][0])
                    prev = step["option"]
                else:
                    action, option = model.student_act(x), None
            frame = env.render()
            writer.append_data(annotate(np.asarray(frame, dtype=np.uint8), option))
            written += 1
            action = torch.max(torch.min(action.float(), high), low)[0].numpy()
            obs, _, terminated, truncated, _ = env.step(action)
            start = torch.tensor([bool(terminated or truncated)])
            if terminated or truncated:
                episode += 1
                obs, _ = env.reset(seed=seed + episode)
    finally:
        writer.close()
        env.close()
    return out, written
