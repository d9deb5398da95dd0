"""The rescale and normalisation of image bytes by a lookup table (``intake/images.py``): every
byte value of every channel through transformers' arithmetic once, then looked up, gives the
arithmetic's bits for every pixel (the processors' own equality is in test_family_towers.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pipepool.intake import images

SCALINGS = [
    (True, 1 / 255, True, images._CLIP_MEAN, images._CLIP_STD),  # CLIP
    (True, 1 / 255, True, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),  # SigLIP
    (True, 0.00392, False, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),  # rescale only
    (False, 1.0, True, (120.0, 110.0, 100.0), (60.0, 50.0, 40.0)),  # normalise bytes
    (False, 1.0, False, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),  # neither: the bytes as floats
]


@pytest.mark.parametrize("scaling", SCALINGS)
def test_the_byte_table_gives_the_arithmetics_bits(scaling):
    array = np.random.default_rng(0).integers(0, 256, (3, 37, 41), dtype=np.uint8)
    array[:, 0, :2] = [[0, 255]] * 3  # both ends of the range
    table = images._byte_table(scaling, 3)
    looked_up = table[np.arange(3)[:, None, None], array]
    want = images._scaled(array, *scaling)
    assert looked_up.dtype == want.dtype == np.float32
    assert np.array_equal(looked_up.view(np.uint32), want.view(np.uint32))
    assert images._byte_table(scaling, 3) is table  # made once


def test_pixel_values_of_a_16_bit_image_take_the_arithmetic():
    """Pixels that are not bytes (a 16-bit grey image kept as it is) are scaled as before."""
    from PIL import Image

    proc = images.ImageProcessing(
        do_resize=False, size={}, resample=3, do_center_crop=False, crop_size=None,
        do_rescale=True, rescale_factor=1 / 65535, do_normalize=True, image_mean=(0.5,),
        image_std=(0.5,), do_convert_rgb=False,
    )  # fmt: skip
    grey = np.random.default_rng(1).integers(0, 65535, (9, 11), dtype=np.uint16)
    image = Image.fromarray(grey.astype(np.int32), mode="I")
    got = proc.pixel_values(image)
    want = images._scaled(np.array(image)[None], True, 1 / 65535, True, (0.5,), (0.5,))
    assert np.array_equal(got, want)
