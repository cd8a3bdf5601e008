"""An encode round of ViT data parallelism between two real processes (gloo): every image reaches the rank
that encodes it with its pixels intact (shapes and dtypes of several kinds, bfloat16 tensors among them, a
rank with no image), the embeddings come back in the images' order, and the pickled messages carry no
pixels (they travel as one tensor per rank)."""

import pickle

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from batchvl.engine.parallel import vit_dp
from batchvl.preprocess.media import PreparedMedia


def fingerprint(image: PreparedMedia) -> torch.Tensor:
    """An embedding that depends on every pixel, the shape and the dtype: (1, 4) float64."""
    pixels = torch.as_tensor(image.pixel_values)
    weights = torch.arange(1, pixels.numel() + 1, dtype=torch.float64)
    checksum = float((pixels.reshape(-1).double() * weights).sum())
    return torch.tensor(
        [[checksum, pixels.numel(), pixels.shape[0], pixels.element_size()]], dtype=torch.float64
    )


def local_encode(images: list[PreparedMedia]) -> list[torch.Tensor]:
    return [fingerprint(image) for image in images]


def images() -> list[PreparedMedia]:
    rng = np.random.default_rng(0)
    # each at least 10 kB of pixels, so that a message carrying any would be larger than all of these
    shapes = [((32, 96), np.float32), ((28, 96), np.float32), ((64, 96), np.float32), ((3, 50, 70), np.uint8)]
    shapes += [((16, 96), np.float64), ((27, 96), np.float32)]
    out = []
    for i, (shape, dtype) in enumerate(shapes):
        pixels = (rng.standard_normal(shape) * 50).astype(dtype)
        out.append(PreparedMedia(pixels, (1, 1, shape[0]), f"hash{i}", 1, "<image>"))
    # bfloat16, cast in the preprocessing workers, is a tensor (numpy has no such dtype)
    bf16 = torch.from_numpy(rng.standard_normal((60, 96)).astype(np.float32)).to(torch.bfloat16)
    out.append(PreparedMedia(bf16, (1, 1, 60), "hash-bf16", 1, "<image>"))
    return out


def round_trip(rank: int, store_path: str, results: dict, pickled_sizes: list) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        if rank == 1:
            vit_dp.serve_encode_rounds(local_encode, torch.device("cpu"))
            return
        scatter_objects = dist.scatter_object_list

        def measuring(received, messages, src):
            if messages is not None:
                pickled_sizes.extend([len(pickle.dumps(message)) for message in messages])
            return scatter_objects(received, messages, src=src)

        dist.scatter_object_list = measuring
        encoder = vit_dp.DataParallelEncoder(
            vit_dp.DistributedContext(0, 2), local_encode, torch.device("cpu")
        )
        results["many"] = [e.tolist() for e in encoder.encode(images())]
        results["one"] = [e.tolist() for e in encoder.encode(images()[:1])]  # rank 1 gets nothing
        results["patches"] = encoder.patches_per_rank
        vit_dp.release_serving_ranks(2)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def round_results(tmp_path_factory):
    with mp.Manager() as manager:
        results, sizes = manager.dict(), manager.list()
        store = str(tmp_path_factory.mktemp("store") / "store")
        mp.spawn(round_trip, args=(store, results, sizes), nprocs=2, join=True)
        return dict(results), list(sizes)


def test_every_image_is_encoded_from_its_own_pixels_in_order(round_results):
    results, _ = round_results
    expected = [fingerprint(image).tolist() for image in images()]
    assert results["many"] == expected
    assert results["one"] == expected[:1]
    assert all(patches > 0 for patches in results["patches"])  # both ranks encoded some


def test_the_pickled_messages_carry_no_pixels(round_results):
    _, sizes = round_results
    smallest = min(image.pixel_values.nbytes for image in images())
    assert smallest >= 10_000
    assert sizes and max(sizes) < 4_000


def test_pixels_after_an_odd_number_of_bytes_are_cut_out_whole():
    """A share's items follow each other byte for byte: an item of wider pixels may start at an offset no
    multiple of their size (after 10,500 uint8 ones), where a tensor view cannot start."""
    shares = [images()[3], images()[4], images()[6]]  # uint8 (3, 50, 70), float64, bfloat16
    described = [vit_dp._described(image) for image in shares]
    received = torch.cat([vit_dp._bytes_of(image.pixel_values) for image in shares])
    for image, got in zip(shares, vit_dp._images_from_bytes(described, received), strict=True):
        expected = torch.as_tensor(image.pixel_values)
        assert got.pixel_values.dtype == expected.dtype and torch.equal(got.pixel_values, expected)
