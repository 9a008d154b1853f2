"""Data preparation for distributed training (the library behind prepare.py).

    from fabtrain.data import prepare, load_manifest, files_for_trainer

    prepare("data/imikolov", 4, input="simple-examples.tgz")
    m = load_manifest("data/imikolov")
    files_for_trainer(m, trainer_id=1, trainer_count=2)
    # ['train.txt-00001', 'train.txt-00003', 'test.txt-00001', 'test.txt-00003',
    #  'word_dict.json', 'MANIFEST.json']

See docs/data.md for the formats and strategies.
"""

from .errors import PrepareError
from .manifest import MANIFEST_NAME, DICT_NAME, files_for_trainer, load_manifest, verify
from .dictionary import load_word_dict
from .strategies import STRATEGIES


def prepare(*args, **kwargs):
    from .pipeline import prepare as _prepare
    return _prepare(*args, **kwargs)


def main(argv=None) -> int:
    from .cli import main as _main
    return _main(argv)


__all__ = ["PrepareError", "MANIFEST_NAME", "DICT_NAME", "STRATEGIES", "files_for_trainer",
           "load_manifest", "verify", "load_word_dict", "prepare", "main"]
