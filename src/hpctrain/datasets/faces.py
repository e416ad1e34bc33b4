"""A generated, learnable face-parsing set in the exact on-disk layout of the CelebAMask-HQ release.

    CelebA-HQ-img/<id>.jpg                                    size x size, JPEG quality 90
    CelebAMask-HQ-mask-anno/<id // 2000>/<id:05d>_<part>.png  one 0/255 "L" mask per present part, mask_size
    CelebA-HQ-to-CelebA-mapping.txt, list_eval_partition.txt  (standard_split) 80/10/10 train/val/test

so everything that reads the release (:mod:`hpctrain.datasets.sources.celebamask`, ``hpctrain shard --format
celebamask``, the faceseg experiment) reads it unchanged. The faces are drawn cartoons with all 18 parts, a random
pose, colours, clutter, light falloff, blur and noise: a small network must localise and use context, yet the parts
have the contrast to be learnt. How they are drawn: draw_face (geometry and painting order), LEFT and mirror_face
(which side is "left").

Image ``i`` depends only on ``(seed, i)`` (``np.random.default_rng([seed, i])``): a set can be written in
parts (``start_id``) and the same seed gives byte-identical files.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from hpctrain.datasets.sources import celebamask
from hpctrain.errors import UserError

LEFT = -1.0  # the l_* parts lie on the image's left (x < 0 in face units): the viewer's left, as in the release
SIDES = (("l", LEFT), ("r", -LEFT))
FACE_UNIT = 0.25  # face half-width as a fraction of the image side at scale 1 (CelebA-HQ framing)
CENTRE = (0.5, 0.45)  # where the face origin sits in the image before the random shift
MAX_ROTATION = math.radians(20)
JPEG_QUALITY = 90
CLASS = {name: i for i, name in enumerate(celebamask.CLASSES)}

# Colour palettes (RGB in 0..1); each draw is jittered, so no part has a fixed colour.
HAIR = ((0.10, 0.08, 0.08), (0.24, 0.16, 0.11), (0.43, 0.29, 0.18), (0.78, 0.66, 0.43), (0.59, 0.24, 0.12),
        (0.58, 0.58, 0.58), (0.85, 0.84, 0.80))
IRIS = ((0.31, 0.20, 0.12), (0.16, 0.12, 0.10), (0.27, 0.43, 0.63), (0.31, 0.47, 0.27), (0.43, 0.47, 0.49),
        (0.47, 0.35, 0.20))
LIPS = ((0.78, 0.35, 0.40), (0.70, 0.15, 0.20), (0.60, 0.28, 0.28), (0.85, 0.45, 0.50), (0.55, 0.10, 0.22))
METAL = ((0.85, 0.68, 0.25), (0.80, 0.80, 0.84), (0.93, 0.91, 0.85))
SKIN_LIGHT, SKIN_DARK = np.array((0.96, 0.80, 0.70)), np.array((0.33, 0.21, 0.14))


def make_faces(root: Path, count: int, size: int = 256, mask_size: int = 128, seed: int = 0,
               standard_split: bool = True, start_id: int = 0) -> Path:
    """Write faces ``start_id .. start_id + count - 1`` under ``root`` in the CelebAMask-HQ layout; with
    ``standard_split`` also the split files, covering every ``<id>.jpg`` then in ``root`` (so a set written
    in parts gets them right from its last part).

    The faces: glasses, hats, earrings, necklaces, an open mouth only sometimes; hair short, long, voluminous or
    none; a random pose (rotation up to 20 degrees, scale, shift), random colours, a cluttered background, light
    falloff, blur and noise. The parts have the contrast to be learnt: white sclera and a dark iris, brows darker
    than the skin, reddish lips, a shaded nose."""
    _check_arguments(count, size, mask_size, start_id)
    (root / celebamask.IMAGES).mkdir(parents=True, exist_ok=True)
    for image_id in range(start_id, start_id + count):
        _write_face(root, image_id, size, mask_size, seed)
    if standard_split:
        write_split_files(root, celebamask.image_ids(root))
    return root


def _check_arguments(count: int, size: int, mask_size: int, start_id: int) -> None:
    if count < 1 or start_id < 0:
        raise UserError(f"cannot generate {count} faces from id {start_id}", "use count >= 1 and start_id >= 0.")
    if size < 16 or mask_size < 8:
        raise UserError(f"image size {size} / mask size {mask_size} is too small to draw a face",
                        "use size >= 16 and mask_size >= 8 (e.g. 256 and 128).")


def write_split_files(root: Path, ids: list[int]) -> None:
    """CelebA's split files for ``ids``: every tenth id (id % 10 == 8) is val, the next (== 9) test, the
    rest train. The faces are independent draws, so a fixed pattern is as good as a random split."""
    mapping = ["idx orig_idx orig_file"]
    partition = []
    for image_id in ids:
        name = f"{image_id + 1:06d}.jpg"  # CelebA numbers its files from 1
        mapping.append(f"{image_id} {image_id + 1} {name}")
        partition.append(f"{name} {0 if image_id % 10 < 8 else image_id % 10 - 7}")
    (root / celebamask.MAPPING).write_text("\n".join(mapping) + "\n")
    (root / celebamask.PARTITION).write_text("\n".join(partition) + "\n")


def _write_face(root: Path, image_id: int, size: int, mask_size: int, seed: int) -> None:
    image, masks = draw_face(np.random.default_rng([seed, image_id]), size, mask_size)
    Image.fromarray(image).save(root / celebamask.IMAGES / f"{image_id}.jpg", quality=JPEG_QUALITY)
    folder = root / celebamask.MASKS / str(image_id // 2000)
    folder.mkdir(parents=True, exist_ok=True)
    for part, mask in masks.items():
        Image.fromarray(mask.astype(np.uint8) * 255, "L").save(folder / f"{image_id:05d}_{part}.png")


def draw_face(rng: np.random.Generator, size: int, mask_size: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One face: the size x size x 3 uint8 image and the present parts' boolean masks at mask_size.

    Geometry. Every part is an implicit shape in face units (x to the image's right, y down, origin between eyes and
    nose, face half-width about 1), evaluated at the pixel centres of each raster through the pose, so the image (at
    ``size``) and the masks (at ``mask_size``) are rasterised from the same shapes, each at its own resolution. The
    masks are written so that the release's painting order (``celebamask.CLASSES``, a later part wins) gives the
    visible stack: parts that lie *behind* an earlier one are cut by it (ears and neck by the face, the neck by the
    necklace and earrings). The image is coloured from that painted label map, so a pixel looks like the part it is
    labelled with; details (iris, pupil, lashes, nostrils, teeth, hair streaks, glasses frames) only vary the colour
    inside their part."""
    f = sample_face(rng)
    X, Y = face_grid(f, size)
    labels, vis = paint(part_masks(f, X, Y))
    image = render(f, rng, X, Y, labels, vis)
    Xm, Ym = face_grid(f, mask_size)
    masks = {p: m for p, m in part_masks(f, Xm, Ym).items() if m.any()}
    return image, masks


# ---------------------------------------------------------------------------------------------------------
# Random face parameters (face units; sides are +-1 multiples, so every draw is mirror-symmetric)


def sample_face(rng: np.random.Generator) -> dict:
    """All the random choices of one face: pose, shape of every part, which optional parts it has, colours."""
    u = rng.uniform
    f: dict = {"rotation": u(-MAX_ROTATION, MAX_ROTATION), "scale": u(0.85, 1.15),
               "shift": (u(-0.06, 0.06), u(-0.05, 0.05)), "a": u(0.9, 1.05), "b": u(1.22, 1.4), "taper": u(0.1, 0.3)}
    _sample_eyes(rng, f)
    _sample_mouth_nose_ears(rng, f)
    _sample_hair(rng, f)
    _sample_accessories(rng, f)
    _sample_body(rng, f)
    f["colours"] = sample_colours(rng, f)
    return f


def _sample_eyes(rng: np.random.Generator, f: dict) -> None:
    u = rng.uniform
    f.update(eye_x=u(0.36, 0.46), eye_y=u(-0.22, -0.08), eye_w=u(0.21, 0.27), eye_tilt=u(-0.12, 0.12),
             gaze=(u(-0.35, 0.35), u(-0.2, 0.2)), iris_r=u(0.55, 0.75))
    openness = u(0.14, 0.25) if rng.random() < 0.1 else u(0.42, 0.62)  # now and then a squint
    f["eye_up"] = f["eye_w"] * openness
    f["eye_low"] = f["eye_up"] * u(0.6, 0.85)
    f.update(brow_x=f["eye_x"] + u(0, 0.05), brow_y=f["eye_y"] - u(0.27, 0.36), brow_w=u(0.24, 0.32),
             brow_t=u(0.08, 0.15), brow_arch=u(0.02, 0.1), brow_slant=u(-0.04, 0.04))


def _sample_mouth_nose_ears(rng: np.random.Generator, f: dict) -> None:
    u = rng.uniform
    f.update(nose_top=f["eye_y"] + u(-0.02, 0.06), nose_tip=u(0.3, 0.42), nose_bridge=u(0.06, 0.1),
             nose_w=u(0.17, 0.24), nose_cap=u(0.1, 0.15), nose_dark_side=float(rng.choice((-1.0, 1.0))))
    f.update(mouth_y=u(0.72, 0.84), mouth_w=u(0.34, 0.46), smile=u(-0.05, 0.07), bow=u(0, 0.5),
             ul=u(0.08, 0.13), ll=u(0.1, 0.16), open=u(0.05, 0.17) if rng.random() < 0.35 else 0.0,
             teeth=rng.random() < 0.6)
    f.update(ear_x=f["a"] * u(0.95, 1.02), ear_y=f["eye_y"] + u(0.0, 0.12), ear_rx=u(0.14, 0.2), ear_ry=u(0.26, 0.34))


def _sample_hair(rng: np.random.Generator, f: dict) -> None:
    u = rng.uniform
    f["hair"] = str(rng.choice(("none", "short", "long", "volume"), p=(0.08, 0.37, 0.37, 0.18)))
    f.update(hairline=u(0.72, 1.05), recede=u(0.2, 0.5), parting=u(-0.12, 0.12), hair_side=u(0.08, 0.2),
             hair_top=u(0.12, 0.35), hair_bottom=u(-0.45, -0.3), fringe=u(0.02, 0.08) if rng.random() < 0.4 else 0.0,
             fringe_freq=u(12, 30), fringe_phase=u(0, 2 * math.pi))
    if rng.random() < 0.3:  # bangs down towards the brows
        f["hairline"] = u(0.55, 0.72)
    f.update(curtain_in=u(0.8, 0.95), curtain_w=u(0.25, 0.5), curtain_spread=u(0.0, 0.2), hair_len=u(1.4, 2.8),
             volume_rx=u(0.3, 0.6), volume_ry=u(0.25, 0.5), volume_bottom=u(0.2, 1.1),
             streak_freq=u(20, 60), streak_phase=u(0, 2 * math.pi))


def _sample_accessories(rng: np.random.Generator, f: dict) -> None:
    u = rng.uniform
    f["hat"] = rng.random() < 0.15
    f.update(hat_y=u(-1.0, -0.6), hat_rx=f["a"] + u(0.12, 0.3), hat_ry=f["b"] * 0.7 + u(0.3, 0.6),
             brim=u(0.3, 0.6) if rng.random() < 0.5 else 0.0, brim_t=u(0.08, 0.14), hat_band=u(0.08, 0.18))
    f["glasses"] = rng.random() < 0.2
    f.update(sunglasses=rng.random() < 0.25, lens_rx=u(0.27, 0.34), lens_ry=u(0.18, 0.26), lens_dy=u(-0.02, 0.05),
             lens_p=float(rng.choice((2.0, 4.0))), frame_t=u(0.025, 0.06))
    sides = [s for _, s in SIDES if rng.random() < 0.85]
    f["earrings"] = (sides or [float(rng.choice((-1.0, 1.0)))]) if rng.random() < 0.25 else []
    f.update(ring_r=u(0.07, 0.13), ring_hoop=rng.random() < 0.4, ring_t=u(0.03, 0.05), ring_dy=u(0.0, 0.06))
    f["necklace"] = rng.random() < 0.2
    f.update(lace_t=u(0.05, 0.09), lace_rise=u(0.15, 0.35), lace_drop=u(0.2, 0.8), bead_freq=u(25, 60))


def _sample_body(rng: np.random.Generator, f: dict) -> None:
    u = rng.uniform
    f.update(neck_w=u(0.38, 0.5), neck_base=u(1.6, 1.9), dip=u(0.1, 0.6), v_neck=rng.random() < 0.4,
             shoulder_slope=u(0.15, 0.35), shoulder_w=u(2.0, 2.6),
             stripes=u(8, 25) if rng.random() < 0.3 else 0.0, stripe_angle=u(-0.5, 0.5))


def sample_colours(rng: np.random.Generator, f: dict) -> dict:
    """The colour of every part for this face, drawn around plausible values."""
    def jitter(c, amount=0.06):
        return np.clip(np.asarray(c, dtype=np.float32) + rng.uniform(-amount, amount, 3), 0, 1).astype(np.float32)

    pick = lambda palette: palette[rng.integers(len(palette))]  # noqa: E731
    skin = jitter(SKIN_LIGHT + (SKIN_DARK - SKIN_LIGHT) * rng.uniform() ** 1.3, 0.04)
    hair = jitter(rng.uniform(0.1, 0.9, 3) if rng.random() < 0.07 else pick(HAIR), 0.05)
    lip_base = np.asarray(pick(LIPS)) * (0.55 + 0.45 * min(1.0, skin.mean() / 0.8))  # darker lips on darker skin
    lip_skin = rng.uniform(0, 0.35)  # how much of the skin tone shows in the lips
    return {
        "skin": skin, "hair": hair, "brow": np.minimum(hair * 0.8, skin * 0.55),
        "lip": jitter(lip_base * (1 - lip_skin) + skin * 0.8 * lip_skin, 0.04),
        "sclera": jitter((0.93, 0.91, 0.88), 0.06), "iris": jitter(pick(IRIS), 0.05),
        "mouth": jitter((0.35, 0.07, 0.1), 0.08), "teeth": jitter((0.9, 0.88, 0.8), 0.05),
        "hat": jitter(rng.uniform(0.05, 0.95, 3), 0), "hat_band": jitter(rng.uniform(0.05, 0.95, 3), 0),
        "frame": jitter((0.12, 0.1, 0.1), 0.08) if rng.random() < 0.7 else jitter(rng.uniform(0, 1, 3), 0),
        "tint": jitter((0.08, 0.08, 0.1), 0.06) if f["sunglasses"] else jitter(rng.uniform(0.3, 1, 3), 0),
        "tint_alpha": rng.uniform(0.75, 0.9) if f["sunglasses"] else rng.uniform(0.1, 0.3),
        "ring": jitter(pick(METAL) if rng.random() < 0.75 else rng.uniform(0, 1, 3), 0.05),
        "lace": jitter(pick(METAL) if rng.random() < 0.75 else rng.uniform(0, 1, 3), 0.05),
        "cloth": jitter(rng.uniform(0.03, 0.97, 3), 0), "cloth2": jitter(rng.uniform(0.03, 0.97, 3), 0),
        "nose": rng.uniform(0.8, 0.9), "ear": rng.uniform(0.88, 0.97), "neck": rng.uniform(0.78, 0.9),
    }


def mirror_face(f: dict) -> dict:
    """The parameters of ``f``'s mirror image, for its shapes (what the masks show): the face flipped left to
    right is another face this generator draws, with every side-bound choice on the other side.

    Left and right. The release does not define its sides in writing; we read them from the viewer's point of view,
    as annotators working on the picture name them and as the common 68-point landmark scheme does: ``l_eye`` is the
    eye on the image's left (the person's right eye). ``LEFT`` holds that choice in one place: the l_* parts lie at
    x < 0 in face units, so in an upright face l_eye, l_brow and l_ear have a smaller column than r_eye, r_brow,
    r_ear (should the real labels prove the other way, set LEFT = 1.0; the tests follow it). Every random choice is
    mirror-symmetric in distribution (hair parting, a single earring's side, gaze, tilt, pose), so a horizontal flip
    with ``celebamask.flip_permutation()`` turns a face and its labels into another face of the same set with
    exactly the labels this generator gives that face. Either reading trains the same network; only the names of
    classes 4-9 swap."""
    g = dict(f, rotation=-f["rotation"], shift=(-f["shift"][0], f["shift"][1]), gaze=(-f["gaze"][0], f["gaze"][1]),
             parting=-f["parting"], fringe_phase=math.pi - f["fringe_phase"], nose_dark_side=-f["nose_dark_side"])
    g["earrings"] = sorted(-side for side in f["earrings"])
    return g


# ---------------------------------------------------------------------------------------------------------
# Geometry: the pose, and every part as an implicit shape in face units


def face_grid(f: dict, res: int) -> tuple[np.ndarray, np.ndarray]:
    """Face-unit coordinates of the pixel centres of a res x res raster (the inverse of the pose)."""
    t = (np.arange(res, dtype=np.float32) + 0.5) / res
    dx = (t - (CENTRE[0] + f["shift"][0]))[None, :]
    dy = (t - (CENTRE[1] + f["shift"][1]))[:, None]
    c, s, k = math.cos(f["rotation"]), math.sin(f["rotation"]), 1.0 / (FACE_UNIT * f["scale"])
    return ((c * dx + s * dy) * k).astype(np.float32), ((-s * dx + c * dy) * k).astype(np.float32)


def _skin(f, X, Y):
    half = np.where(Y > 0, f["a"] * (1 - f["taper"] * np.clip(Y / f["b"], 0, 1)), f["a"])
    return (X / half) ** 2 + (Y / f["b"]) ** 2 < 1


def eye_coords(f, side, X, Y):
    """Coordinates along (u, -1..1 corner to corner) and across (v, down) one eye, tilted mirror-symmetrically."""
    c, s = math.cos(side * f["eye_tilt"]), math.sin(side * f["eye_tilt"])
    dx, dy = X - side * f["eye_x"], Y - f["eye_y"]
    return (c * dx + s * dy) / f["eye_w"], -s * dx + c * dy


def _eye(f, side, X, Y):
    u, v = eye_coords(f, side, X, Y)
    g = np.clip(1 - u * u, 0, None) ** 0.7
    return (np.abs(u) < 1) & (v > -f["eye_up"] * g) & (v < f["eye_low"] * g)


def _brow(f, side, X, Y):
    u = side * (X - side * f["brow_x"]) / f["brow_w"]  # -1 at the inner end, +1 at the outer
    centre = f["brow_y"] - f["brow_arch"] * (1 - u * u) + f["brow_slant"] * u
    half = f["brow_t"] / 2 * (1.2 - 0.2 * (u + 1))  # thicker at the inner end
    return (np.abs(u) <= 1) & (np.abs(Y - centre) < half)


def nose_half_width(f, Y):
    t = np.clip((Y - f["nose_top"]) / (f["nose_tip"] - f["nose_top"]), 0, 1)
    return f["nose_bridge"] + (f["nose_w"] - f["nose_bridge"]) * t * t


def _nose(f, X, Y):
    body = (Y >= f["nose_top"]) & (Y <= f["nose_tip"]) & (np.abs(X) < nose_half_width(f, Y))
    cap = (Y > f["nose_tip"]) & ((X / f["nose_w"]) ** 2 + ((Y - f["nose_tip"]) / f["nose_cap"]) ** 2 < 1)
    return body | cap


def lip_curves(f, X):
    """Along the mouth: u (-1..1), the line where the lips meet, half the opening, lip heights."""
    u = X / f["mouth_w"]
    g = np.clip(1 - u * u, 0, None)
    line = f["mouth_y"] - f["smile"] * u * u
    bow = 1 - f["bow"] * np.exp(-(u / 0.18) ** 2)  # the dip of the upper lip's middle
    return u, line, f["open"] / 2 * g ** 0.8, f["ul"] * np.sqrt(g) * bow, f["ll"] * np.sqrt(g)


def _lips(f, X, Y):
    """The inner mouth (empty when closed), the upper lip and the lower lip."""
    u, line, half, up, low = lip_curves(f, X)
    inside, below = np.abs(u) < 1, Y - line  # below: how far under the line where the lips meet
    return (inside & (np.abs(below) < half), inside & (below < -half) & (below > -half - up),
            inside & (below >= half) & (below < half + low))


def _ear(f, side, X, Y):
    return ((X - side * f["ear_x"]) / f["ear_rx"]) ** 2 + ((Y - f["ear_y"]) / f["ear_ry"]) ** 2 < 1


def hairline(f, X):
    """The lower edge of the hair over the forehead: receding at the temples, maybe parted, maybe ragged."""
    ragged = f["fringe"] * np.sin(f["fringe_freq"] * X + f["fringe_phase"])
    return -f["hairline"] + f["recede"] * (X / f["a"]) ** 2 + f["parting"] * X + ragged


def _hair(f, X, Y):
    if f["hair"] == "none":
        return np.zeros(X.shape, bool)
    if f["hair"] == "volume":  # a bob or an afro: all round the face, over the ears
        outer = (X / (f["a"] + f["volume_rx"])) ** 2 + ((Y + 0.35) / (f["b"] + f["volume_ry"])) ** 2 < 1
        face = (Y > hairline(f, X)) & (np.abs(X) < f["a"] * 0.92)
        return outer & ~face & (Y < f["volume_bottom"])
    cap_y = -0.25
    cap_ry = f["b"] + f["hair_top"] + cap_y
    cap = ((X / (f["a"] + f["hair_side"])) ** 2 + ((Y - cap_y) / cap_ry) ** 2 < 1) & (Y < hairline(f, X))
    cap &= Y < f["hair_bottom"]
    if f["hair"] == "short":
        return cap
    ax, below = np.abs(X), np.clip(Y, 0, None)
    inner = f["a"] * f["curtain_in"] + f["curtain_spread"] * below
    outer = f["a"] + f["curtain_w"] + 1.5 * f["curtain_spread"] * below
    top = f["hair_bottom"] - 0.3 + np.clip(ax - f["a"], 0, None)  # meets the cap in a slope, not a step
    return cap | ((ax > inner) & (ax < outer) & (Y > top) & (Y < f["hair_len"]))


def _hat(f, X, Y):
    crown = ((X / f["hat_rx"]) ** 2 + ((Y - f["hat_y"]) / f["hat_ry"]) ** 2 < 1) & (Y < f["hat_y"])
    brim = (np.abs(X) < f["hat_rx"] + f["brim"]) & (Y < f["hat_y"]) & (Y > f["hat_y"] - f["brim_t"])
    return crown | brim if f["brim"] else crown


def lens(f, side, X, Y, inset=0.0):
    p = f["lens_p"]
    dx = np.abs(X - side * f["eye_x"]) / (f["lens_rx"] - inset)
    dy = np.abs(Y - f["eye_y"] - f["lens_dy"]) / (f["lens_ry"] - inset)
    return dx ** p + dy ** p < 1


def glasses_frame(f, X, Y):
    """The frame: lens rims, the bridge over the nose and the temples back to the ears."""
    t = f["frame_t"]
    rims = [lens(f, s, X, Y) & ~lens(f, s, X, Y, t) for _, s in SIDES]
    bridge_y = f["eye_y"] + f["lens_dy"] - 0.35 * f["lens_ry"]
    bridge = (np.abs(X) < f["eye_x"] - 0.8 * f["lens_rx"]) & (np.abs(Y - bridge_y) < t)
    temple_x = np.abs(X)
    temples = (temple_x > f["eye_x"] + 0.8 * f["lens_rx"]) & (temple_x < f["a"] + 0.12)
    temples &= np.abs(Y - (f["eye_y"] + f["lens_dy"] - 0.4 * f["lens_ry"])) < 0.8 * t
    return rims[0] | rims[1] | bridge | temples


def _eye_g(f, X, Y):
    return lens(f, -1.0, X, Y) | lens(f, 1.0, X, Y) | glasses_frame(f, X, Y)


def earring_centre(f, side):
    return side * f["ear_x"], f["ear_y"] + 0.8 * f["ear_ry"] + f["ring_r"] + f["ring_dy"]


def _ear_r(f, X, Y):
    out = np.zeros(X.shape, bool)
    for side in f["earrings"]:
        cx, cy = earring_centre(f, side)
        d2 = (X - cx) ** 2 + (Y - cy) ** 2
        ring = d2 < f["ring_r"] ** 2
        if f["ring_hoop"]:
            ring &= d2 > (f["ring_r"] - f["ring_t"]) ** 2
        out |= ring
    return out


def necklace_curve(f, X):
    """The chain's centre line: high at the sides of the neck, hanging lowest in front."""
    u = X / (1.1 * f["neck_w"])
    sag = (f["lace_rise"] + f["dip"]) * f["lace_drop"]  # stays above the neckline's lowest point
    return u, f["neck_base"] - f["lace_rise"] + sag * (1 - u * u)


def _neck_l(f, X, Y):
    u, centre = necklace_curve(f, X)
    return (np.abs(u) < 1) & (np.abs(Y - centre) < f["lace_t"] / 2)


def _neck(f, X, Y):
    flare = np.clip(Y - (f["neck_base"] - 0.25), 0, None) * 1.2  # the neck widens into the chest and shoulders
    return (Y > 0.3) & (np.abs(X) < f["neck_w"] + flare)


def _cloth(f, X, Y):
    ax, w = np.abs(X), f["neck_w"]
    r = np.clip(ax / w, 0, 1)
    neckline = f["neck_base"] + f["dip"] * (1 - (r if f["v_neck"] else r * r))
    shoulder = f["neck_base"] + f["shoulder_slope"] * np.clip(ax - w, 0, None) ** 1.3
    top = np.where(ax < w, neckline, shoulder)
    return (Y > top) & (ax < f["shoulder_w"] + 0.5 * np.clip(Y - f["neck_base"], 0, None))


def part_masks(f: dict, X: np.ndarray, Y: np.ndarray) -> dict[str, np.ndarray]:
    """Every part this face has, in CLASSES order, cut so that painting them in that order shows what is
    in front: ears and neck lie behind the face, the neck behind the necklace and earrings. The small
    parts are evaluated only in their bounding boxes (``boxes``), which halves the cost."""
    box = boxes(f)
    m: dict[str, np.ndarray] = {"skin": _skin(f, X, Y), "nose": _local(f, X, Y, box["nose"], _nose)}
    if f["glasses"]:
        m["eye_g"] = _local(f, X, Y, box["eye_g"], _eye_g)
    if not (f["glasses"] and f["sunglasses"]):  # dark lenses hide the eyes, as unlabelled in the release
        for name, side in SIDES:
            m[f"{name}_eye"] = _local(f, X, Y, box[f"{name}_eye"], _eye, side)
    for name, side in SIDES:
        m[f"{name}_brow"] = _local(f, X, Y, box[f"{name}_brow"], _brow, side)
    for name, side in SIDES:
        m[f"{name}_ear"] = _local(f, X, Y, box[f"{name}_ear"], _ear, side) & ~m["skin"]
    mouth, m["u_lip"], m["l_lip"] = _local(f, X, Y, box["mouth"], _lips)
    if f["open"]:
        m["mouth"] = mouth
    m["hair"] = _hair(f, X, Y)
    if f["hat"]:
        m["hat"] = _hat(f, X, Y)
    if f["earrings"]:
        m["ear_r"] = _ear_r(f, X, Y)
    if f["necklace"]:
        m["neck_l"] = _neck_l(f, X, Y)
    behind = m["skin"] | m["l_ear"] | m["r_ear"] | m.get("ear_r", False) | m.get("neck_l", False)
    m["neck"] = _neck(f, X, Y) & ~behind
    m["cloth"] = _cloth(f, X, Y)
    return m


def boxes(f: dict) -> dict[str, tuple[float, float, float, float]]:
    """Face-unit rectangles (x0, y0, x1, y1) that hold the small parts, with a margin."""
    out = {}
    for name, side in SIDES:
        ex, bx = side * f["eye_x"], side * f["brow_x"]
        reach = f["eye_w"] + 0.1  # the tilt lifts a corner by at most sin(0.12) * eye_w
        out[f"{name}_eye"] = (ex - reach, f["eye_y"] - f["eye_up"] - 0.1, ex + reach, f["eye_y"] + f["eye_up"] + 0.1)
        out[f"{name}_brow"] = (bx - f["brow_w"] - 0.05, f["brow_y"] - 0.3, bx + f["brow_w"] + 0.05, f["brow_y"] + 0.2)
        ear = side * f["ear_x"]
        out[f"{name}_ear"] = (ear - f["ear_rx"] - 0.05, f["ear_y"] - f["ear_ry"] - 0.05,
                              ear + f["ear_rx"] + 0.05, f["ear_y"] + f["ear_ry"] + 0.05)
    nose_w, mouth_w = f["nose_w"] + 0.05, f["mouth_w"] + 0.05
    out["nose"] = (-nose_w, f["nose_top"] - 0.05, nose_w, f["nose_tip"] + f["nose_cap"] + 0.05)
    rise = abs(f["smile"]) + f["open"] / 2 + 0.05
    out["mouth"] = (-mouth_w, f["mouth_y"] - rise - f["ul"], mouth_w, f["mouth_y"] + rise + f["ll"])
    lens_y = f["eye_y"] + f["lens_dy"]
    out["eye_g"] = (-f["a"] - 0.2, lens_y - f["lens_ry"] - 0.05, f["a"] + 0.2, lens_y + f["lens_ry"] + 0.05)
    return out


def _local(f, X, Y, box, shape, *args):
    """``shape(f, *args, X, Y)`` on the pixels of the raster's bounding box of the face-unit rectangle
    ``box`` only, False elsewhere (one mask, or a tuple of masks as the shape gives)."""
    x0, y0, x1, y1 = box
    corners = np.array([(x0, y0), (x1, y0), (x0, y1), (x1, y1)])
    c, s, k, res = math.cos(f["rotation"]), math.sin(f["rotation"]), FACE_UNIT * f["scale"], X.shape[0]
    cols = (CENTRE[0] + f["shift"][0] + k * (c * corners[:, 0] - s * corners[:, 1])) * res - 0.5  # face_grid inverted
    rows = (CENTRE[1] + f["shift"][1] + k * (s * corners[:, 0] + c * corners[:, 1])) * res - 0.5
    window = (slice(max(0, math.floor(rows.min())), max(0, math.ceil(rows.max()) + 1)),
              slice(max(0, math.floor(cols.min())), max(0, math.ceil(cols.max()) + 1)))
    found = shape(f, *args, X[window], Y[window])
    outs = []
    for part in found if isinstance(found, tuple) else (found,):
        out = np.zeros(X.shape, bool)
        out[window] = part
        outs.append(out)
    return tuple(outs) if isinstance(found, tuple) else outs[0]


def paint(masks: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The label map as celebamask.label_map paints it (CLASSES order, later wins), and the same without
    the glasses: what their lenses let through."""
    shape = next(iter(masks.values())).shape
    labels, vis = np.zeros(shape, np.uint8), np.zeros(shape, np.uint8)
    for part in celebamask.PARTS:
        if part in masks:
            labels[masks[part]] = CLASS[part]
            if part != "eye_g":
                vis[masks[part]] = CLASS[part]
    return labels, vis


# ---------------------------------------------------------------------------------------------------------
# The image: colours by label, details inside the parts, then background, light, blur and noise


def render(f: dict, rng: np.random.Generator, X: np.ndarray, Y: np.ndarray, labels: np.ndarray,
           vis: np.ndarray) -> np.ndarray:
    """The uint8 image of a face whose painted label map is ``labels`` (``vis``: the same seen through
    the glasses' lenses)."""
    c, size = f["colours"], X.shape[0]
    table = np.zeros((len(celebamask.CLASSES), 3), np.float32)
    for part, colour in (("skin", c["skin"]), ("nose", c["skin"] * c["nose"]), ("l_eye", c["sclera"]),
                         ("r_eye", c["sclera"]), ("l_brow", c["brow"]), ("r_brow", c["brow"]),
                         ("l_ear", c["skin"] * c["ear"]), ("r_ear", c["skin"] * c["ear"]), ("mouth", c["mouth"]),
                         ("u_lip", c["lip"] * 0.88), ("l_lip", c["lip"]), ("hair", c["hair"]), ("hat", c["hat"]),
                         ("ear_r", c["ring"]), ("neck_l", c["lace"]), ("neck", c["skin"] * c["neck"]),
                         ("cloth", c["cloth"])):
        table[CLASS[part]] = colour
    img = table[vis]
    _skin_shading(f, X, Y, vis, img)
    _eye_details(f, X, Y, vis, img)
    _nose_and_mouth_details(f, X, Y, vis, img)
    _hair_and_wear_details(f, X, Y, vis, img)
    img = np.where((vis == 0)[..., None], background(rng, size), img)
    if f["glasses"]:
        _glasses(f, X, Y, labels, img)
    return _photograph(rng, img)


def _where(vis, *parts):
    out = vis == CLASS[parts[0]]
    for part in parts[1:]:
        out |= vis == CLASS[part]
    return out


def _skin_shading(f, X, Y, vis, img):
    """Skin darkens towards the face's outline and the neck under the jaw, as under frontal light; a fold
    inside each ear."""
    face = _where(vis, "skin", "nose", "l_ear", "r_ear")
    x, y = X[face], Y[face]
    r2 = (x / f["a"]) ** 2 + (y / f["b"]) ** 2
    shade = 1 - 0.22 * np.clip(r2 - 0.45, 0, 1)
    ear = ~_where(vis[face], "skin", "nose")
    for side in (-1.0, 1.0):
        dx = x - side * f["ear_x"]
        d = np.sqrt((dx / f["ear_rx"]) ** 2 + ((y - f["ear_y"]) / f["ear_ry"]) ** 2)
        shade[ear & (d > 0.4) & (d < 0.65) & (side * dx > -0.03)] *= 0.72  # a ring on the outer half
    img[face] *= shade[:, None]
    neck = vis == CLASS["neck"]
    img[neck] *= (0.72 + 0.28 * np.clip((Y[neck] - f["b"]) / 0.5, 0, 1))[:, None]


def _eye_details(f, X, Y, vis, img):
    """Iris and pupil where the gaze points, and the dark line of the upper lashes."""
    c = f["colours"]
    for name, side in SIDES:
        eye = vis == CLASS[f"{name}_eye"]
        u, v = eye_coords(f, side, X[eye], Y[eye])
        colour = img[eye]
        iris_r = f["iris_r"] * (f["eye_up"] + f["eye_low"])
        dist = np.hypot((u - f["gaze"][0]) * f["eye_w"], v - f["gaze"][1] * f["eye_low"])
        colour[dist < iris_r] = c["iris"]
        colour[dist < 0.45 * iris_r] = (0.04, 0.03, 0.03)
        colour[v < -f["eye_up"] * np.clip(1 - u * u, 0, None) ** 0.7 + 0.035] = c["brow"] * 0.5
        img[eye] = colour


def _nose_and_mouth_details(f, X, Y, vis, img):
    """Nostrils, a shaded side and outline to the nose; teeth in an open mouth; the line between the lips."""
    c = f["colours"]
    nose = vis == CLASS["nose"]
    x, y, colour = X[nose], Y[nose], img[nose]
    colour[f["nose_dark_side"] * x > 0] *= 0.9
    colour[(np.abs(x) > nose_half_width(f, y) - 0.025) & (y < f["nose_tip"])] *= 0.85
    nostril_y = ((y - f["nose_tip"] - 0.3 * f["nose_cap"]) / (0.35 * f["nose_cap"])) ** 2
    for side in (-1.0, 1.0):
        colour[((x - side * 0.5 * f["nose_w"]) / (0.28 * f["nose_w"])) ** 2 + nostril_y < 1] = c["skin"] * 0.35
    img[nose] = colour
    mouth = _where(vis, "mouth", "u_lip", "l_lip")
    x, y, colour, part = X[mouth], Y[mouth], img[mouth], vis[mouth]
    _, line, half, _, low = lip_curves(f, x)
    if f["teeth"]:
        colour[(part == CLASS["mouth"]) & (y < line - 0.1 * half)] = c["teeth"]
    colour[(part != CLASS["mouth"]) & (np.abs(y - line) < half + 0.015)] *= 0.7
    shine = (part == CLASS["l_lip"]) & (np.abs(y - (line + half + 0.4 * low)) < 0.2 * low)
    colour[shine] = np.minimum(colour[shine] * 1.2, 1)
    img[mouth] = colour


def _hair_and_wear_details(f, X, Y, vis, img):
    """Streaks in the hair, a band on the hat, beads, a highlight on earrings, stripes and folds on cloth."""
    c = f["colours"]
    hair = vis == CLASS["hair"]
    angle = np.arctan2(Y[hair] + f["b"], X[hair])  # streaks fan out from the crown
    img[hair] *= (0.82 + 0.18 * np.sin(f["streak_freq"] * angle + f["streak_phase"]))[:, None]
    hat = vis == CLASS["hat"]
    if f["brim"]:  # a darker brim
        img[hat & (Y > f["hat_y"] - f["brim_t"])] *= 0.7
    else:  # a folded band at the bottom of a beanie
        img[hat & (Y > f["hat_y"] - f["hat_band"])] = c["hat_band"]
    lace = vis == CLASS["neck_l"]
    img[lace] *= (0.7 + 0.3 * (np.sin(f["bead_freq"] * X[lace]) > 0))[:, None]
    ring = vis == CLASS["ear_r"]
    for side in f["earrings"]:
        cx, cy = earring_centre(f, side)
        r = f["ring_r"]
        shine = ring & ((X - cx + 0.3 * r) ** 2 + (Y - cy + 0.3 * r) ** 2 < (0.35 * r) ** 2)  # upper left
        img[shine] = np.minimum(img[shine] * 1.35 + 0.1, 1)
    cloth = vis == CLASS["cloth"]
    x, y, colour = X[cloth], Y[cloth], img[cloth]
    if f["stripes"]:
        colour[np.sin(f["stripes"] * (y + f["stripe_angle"] * x)) > 0.3] = c["cloth2"]
    img[cloth] = colour * (0.85 + 0.15 * np.cos(3.0 * x))[:, None]  # the chest catches more light than the arms


def _glasses(f, X, Y, labels, img):
    """Tinted lenses over whatever lies behind them, and the frame."""
    c = f["colours"]
    glass = labels == CLASS["eye_g"]
    a = c["tint_alpha"]
    img[glass] = img[glass] * (1 - a) + c["tint"] * a
    img[glass & glasses_frame(f, X, Y)] = c["frame"]


def background(rng: np.random.Generator, size: int) -> np.ndarray:
    """A gradient between two random colours under random blobs and stripes (some in skin and hair colours,
    so colour alone cannot tell the face from the wall) and a soft mottle, out of focus. Drawn at half the
    resolution (it is blurred anyway: that halves the cost) and scaled up."""
    n = max(8, size // 2)
    c0, c1 = rng.uniform(0, 1, (2, 3))
    angle = rng.uniform(0, 2 * math.pi)
    t = (np.arange(n, dtype=np.float32) + 0.5) / n - 0.5
    ramp = np.clip(0.5 + t[None, :] * math.cos(angle) + t[:, None] * math.sin(angle), 0, 1)
    mottle = Image.fromarray(np.uint8(rng.uniform(0, 255, (6, 6, 3)))).resize((n, n), Image.BICUBIC)
    base = c0 + (c1 - c0) * ramp[..., None] + 0.16 * (np.asarray(mottle, np.float32) / 255 - 0.5)
    canvas = Image.fromarray(np.uint8(np.clip(base, 0, 1) * 255))
    draw = ImageDraw.Draw(canvas)
    for _ in range(rng.integers(0, 7)):
        cx, cy, rx, ry = rng.uniform(0, 1, 2).tolist() + rng.uniform(0.04, 0.3, 2).tolist()
        draw.ellipse([(cx - rx) * n, (cy - ry) * n, (cx + rx) * n, (cy + ry) * n], fill=_clutter(rng))
    for _ in range(rng.integers(0, 4)):
        x0, y0, x1, y1 = (rng.uniform(-0.2, 1.2, 4) * n).tolist()
        draw.line([x0, y0, x1, y1], fill=_clutter(rng), width=max(1, int(rng.uniform(0.02, 0.12) * n)))
    canvas = canvas.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.5) * n / 128))
    return np.asarray(canvas.resize((size, size), Image.BILINEAR), np.float32) / 255


def _clutter(rng: np.random.Generator) -> tuple[int, int, int]:
    """A random colour, a third of the time one of skin or hair."""
    r = rng.random()
    if r < 0.17:
        colour = SKIN_LIGHT + (SKIN_DARK - SKIN_LIGHT) * rng.uniform()
    elif r < 0.33:
        colour = np.asarray(HAIR[rng.integers(len(HAIR))])
    else:
        colour = rng.uniform(0, 1, 3)
    return tuple(int(v) for v in np.clip(colour * 255 + rng.uniform(-15, 15, 3), 0, 255))


def _photograph(rng: np.random.Generator, img: np.ndarray) -> np.ndarray:
    """Uneven light across the picture, a slight blur and sensor noise."""
    size = img.shape[0]
    t = (np.arange(size, dtype=np.float32) + 0.5) / size - 0.5
    gx, gy = rng.uniform(-0.35, 0.35, 2).tolist()
    img = img * (1 + gx * t[None, :, None] + gy * t[:, None, None]) * rng.uniform(0.85, 1.1)
    blurred = Image.fromarray(np.uint8(np.clip(img, 0, 1) * 255 + 0.5)).filter(
        ImageFilter.BoxBlur(rng.uniform(0.3, 0.8) * size / 256))  # one box pass: a third of a Gaussian's cost
    noise = (rng.random((size, size, 3), dtype=np.float32) - 0.5) * rng.uniform(5, 17)  # uniform, sd 1.5 to 5
    return np.clip(np.asarray(blurred, np.float32) + noise + 0.5, 0, 255).astype(np.uint8)
