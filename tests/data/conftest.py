"""Shared fixtures for the prompt-set tests.

The loaders cache parsed sources (ShareGPT, CHAMP) in the user cache dir, exactly as in normal use;
tests that exercise the cache itself point it at a temporary directory instead.
"""

import pytest

from adaflash.data import sharegpt


@pytest.fixture(scope="session")
def sharegpt_parsed():
    """ShareGPT parsed from the package file (no cache), once per session (~3 s)."""
    return sharegpt._build()
