"""What an image's embedding depends on besides its pixels, as one digest: the key of the encoder disk
cache's entries is this digest with the image's content hash (which already covers the preprocessed
pixels, their normalization, the patch grid and the media kind, so every preprocessing setting that changes
the tower's input).

The digest covers the vision tower's weights (every parameter and buffer of the model outside its
language model and token embeddings: the tower and the projector into the decoder), read from memory
once at load, so a checkpoint changed in place is a new digest; the dtype; the device kind and what
changes a device's numerics (the GPU's name, or the CPU's vector ISA and whether batchvl's native kernels
run); the family's adapter, torch's version and batchvl's, whose kernels compute the tower.

Reading every weight is not free on a CPU, where packed weights are unpacked to be read (0.4 s for the
`small` model's 50 MB tower in bf16 on 2 cores; at that rate seconds for a 2B model's 1.3 GB), so the
digest is remembered in the cache folder under the checkpoint's weight files as they are on disk (path,
size, inode, modification and change times: any write to a file changes its change time, which no tool
sets back) and the numerics above, and computed again only when one of them changed. A model whose
weights were changed in memory after loading (which batchvl's packed layers do not support) is not seen.
A remembered digest is stored with a checksum of it and of what it was computed for, and one that fails
it (damaged, cut short, copied under another name, or written by an earlier version) is computed again
and rewritten: a wrong digest would read another tower's entries. Like the entries' checksums, this
guards against damage, not against someone who can write the folder (who could write entries as well).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
from pathlib import Path

import torch
import xxhash

from batchvl.engine.encoder_cache.disk_layout import DIGESTS, write_file
from batchvl.layers.native_kernels import native_ops
from batchvl.version import __version__


def vision_digest(adapter, folder: str) -> str:
    """The digest of what `adapter`'s embeddings depend on besides the image (an adapter with `model`
    and `language_model`, as every Hugging Face family's has), remembered under `folder`."""
    numerics = _numerics(adapter)
    stamp = _checkpoint_stamp(adapter.model)
    if stamp is None:
        return _weights_digest(adapter, numerics)
    what = "\0".join(numerics + stamp)  # what the digest is remembered under, and checked against
    remembered = os.path.join(folder, DIGESTS, xxhash.xxh3_128_hexdigest(what.encode()))
    digest = _recall(remembered, what)
    if digest is None:
        digest = _weights_digest(adapter, numerics)
        _remember(remembered, what, digest)
    return digest


def _recall(remembered: str, what: str) -> str | None:
    """The digest remembered for `what`, or None where there is none or it fails its check (a file cut
    short, damaged, or written for something else): a wrong digest would read another tower's entries."""
    try:
        text = Path(remembered).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError):
        return None
    match = re.fullmatch("([0-9a-f]{32}) ([0-9a-f]{32})", text)
    if match is None or match[2] != _check(what, match[1]):
        return None
    return match[1]


def _remember(remembered: str, what: str, digest: str) -> None:
    with contextlib.suppress(OSError):  # not remembered: computed again next time
        write_file(remembered, f"{digest} {_check(what, digest)}".encode("ascii"))


def _check(what: str, digest: str) -> str:
    """A checksum of the digest with what it was computed for: the file holds both halves or neither."""
    return xxhash.xxh3_128_hexdigest(f"{what}\0{digest}".encode())


def _weights_digest(adapter, numerics: list[str]) -> str:
    digest = xxhash.xxh3_128()
    for part in numerics:
        digest.update(part.encode())
        digest.update(b"\0")
    for name, tensor in _vision_tensors(adapter):
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}\0".encode())
        digest.update(_plain(tensor).reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _checkpoint_stamp(model) -> list[str] | None:
    """The weight files the model was loaded from as they are on disk, or None where they are not known
    (a model built in memory)."""
    path = getattr(model, "name_or_path", "")
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")) + glob.glob(os.path.join(path, "*.bin")))
    stamp = []
    for file in files:
        try:
            st = os.stat(file)
        except OSError:
            return None
        stamp.append(f"{os.path.abspath(file)}:{st.st_size}:{st.st_ino}:{st.st_mtime_ns}:{st.st_ctime_ns}")
    return stamp or None


def _numerics(adapter) -> list[str]:
    device = adapter.device
    if device.type == "cuda":
        machine = torch.cuda.get_device_name(device)
    else:
        machine = f"{torch.backends.cpu.get_cpu_capability()} native={native_ops() is not None}"
    return [
        type(adapter).__name__,
        str(adapter.dtype),
        device.type,
        machine,
        torch.__version__,
        __version__,
    ]


def _vision_tensors(adapter) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters and buffers that are not the language model's or the token embeddings'."""
    model = adapter.model
    text_modules = [adapter.language_model, model.get_input_embeddings(), model.get_output_embeddings()]
    text = {id(t) for module in text_modules if module is not None for t in _tensors_of(module)}
    named = [*model.named_parameters(), *model.named_buffers()]
    return [(name, tensor) for name, tensor in named if id(tensor) not in text]


def _tensors_of(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor of the same values: weights packed for oneDNN are opaque until made dense
    (and their dense form is the same on every CPU, where the packed layout is not)."""
    if tensor.is_mkldnn:
        tensor = tensor.to_dense()
    return tensor.detach().to("cpu").contiguous()
