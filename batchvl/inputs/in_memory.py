"""What a notebook hands `caption` besides a `datasets.Dataset`: a list of images (PIL images, paths, URLs,
encoded bytes) or a pandas DataFrame, made into the one-split dataset `caption` stages, its rows in the
given order so that each result's key is the image's index in the list or the frame."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from batchvl.errors import UserError

if TYPE_CHECKING:
    import datasets

DATASET_HINT = "build one with datasets.Dataset.from_dict({...}), .from_pandas(df) or .from_list([...])"


def as_dataset(data: Any, image_column: str) -> datasets.Dataset:
    """`data` as a `datasets.Dataset`: a Dataset as it is; a pandas DataFrame by `from_pandas` (its index
    dropped: keys are row positions); a list or tuple of images as one column named `image_column`, PIL
    images and encoded bytes in datasets' `Image` feature, or paths and URLs as text, None as a row with no
    image."""
    import datasets

    if isinstance(data, datasets.DatasetDict):
        raise UserError(f"caption() takes one split, e.g. dataset['{next(iter(data))}'], not a DatasetDict")
    if isinstance(data, datasets.Dataset):
        return data
    if _is_data_frame(data):
        return datasets.Dataset.from_pandas(data, preserve_index=False)
    if isinstance(data, list | tuple):
        return _images_dataset(list(data), image_column)
    raise UserError(
        f"caption() takes a datasets.Dataset, a pandas DataFrame or a list of images, got "
        f"{type(data).__name__}; {DATASET_HINT}"
    )


def _is_data_frame(data: Any) -> bool:
    # by its class, so that pandas is imported only where a frame was given
    return any(
        cls.__module__.startswith("pandas") and cls.__name__ == "DataFrame" for cls in type(data).__mro__
    )


def _images_dataset(images: list, image_column: str) -> datasets.Dataset:
    import datasets
    from PIL import Image

    def _features(feature) -> datasets.Features:
        return datasets.Features({image_column: feature})

    if not images:
        raise UserError("caption() was given an empty list: there is nothing to caption")
    wrong = [
        image for image in images if not isinstance(image, Image.Image | bytes | str | os.PathLike | None)
    ]
    if wrong:
        raise UserError(
            f"caption() takes a list of images (PIL images, paths, URLs or encoded bytes), but it holds a "
            f"{type(wrong[0]).__name__}; {DATASET_HINT}"
        )
    texts = [isinstance(image, str | os.PathLike) for image in images if image is not None]
    if any(texts) and not all(texts):
        raise UserError(
            "caption() takes a list of images or a list of paths and URLs, not both in one list; save the "
            "images to files, or open the paths with PIL.Image.open"
        )
    if any(texts):  # paths (read against `root=`) and URLs, as a text column of a Dataset is read
        cells = [None if image is None else os.fspath(image) for image in images]
        return datasets.Dataset.from_dict({image_column: cells}, features=_features(datasets.Value("string")))
    # PIL images and bytes alike, encoded by datasets' Image feature
    return datasets.Dataset.from_dict({image_column: images}, features=_features(datasets.Image()))
