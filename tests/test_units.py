import pytest

from tiertune.errors import ConfigError
from tiertune.settings import parse_size
from tiertune.units import format_size, round_up


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512KiB", 512 * 1024),
        ("20GiB", 20 * 1024**3),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        (7, 7),
        ("2 mib", 2 << 20),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "-1GiB", "12 parsecs", "", True, -5])
def test_parse_size_rejects_with_the_setting_named(bad):
    with pytest.raises(ConfigError, match="offload.host_budget"):
        parse_size(bad, "offload.host_budget")


def test_format_and_round_up():
    assert format_size(1536) == "1.50 KiB"
    assert format_size(3) == "3 B"
    assert round_up(1, 4096) == 4096
    assert round_up(8192, 4096) == 8192


def test_import_is_light_and_the_api_is_lazy():
    import subprocess
    import sys

    code = (
        "import sys, tiertune; heavy = [m for m in ('torch', 'transformers') if m in sys.modules]; "
        "assert not heavy, heavy; assert callable(tiertune.train) and 'torch' in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
