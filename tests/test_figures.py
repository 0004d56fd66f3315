"""Figures written to files (kvevict.figures): the non-interactive backend, and a figure laid
out, saved as a PNG at 120 dpi into folders made for it, then freed."""

from __future__ import annotations

import struct

import matplotlib

from kvevict.figures import pyplot, save_figure


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a PNG, from its IHDR chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_pyplot_draws_on_the_agg_backend() -> None:
    plt = pyplot()
    assert plt.__name__ == "matplotlib.pyplot"
    assert matplotlib.get_backend().lower() == "agg"


def test_a_figure_is_saved_as_a_png_at_120_dpi_into_new_folders_and_closed(tmp_path) -> None:
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(2, 1.5))
    axes.plot([0, 1], [1, 0])
    path = save_figure(figure, str(tmp_path / "a" / "b" / "plot.png"))
    assert path == tmp_path / "a" / "b" / "plot.png"
    assert png_size(path.read_bytes()) == (240, 180)  # 2 x 1.5 inches at 120 dpi
    assert figure.number not in plt.get_fignums()


def test_layout_options_go_to_tight_layout(tmp_path) -> None:
    figure = pyplot().figure()
    laid_out = []
    figure.tight_layout = lambda **layout: laid_out.append(layout)
    save_figure(figure, tmp_path / "plot.png", rect=(0, 0, 1, 0.9), pad=0.5)
    assert laid_out == [{"rect": (0, 0, 1, 0.9), "pad": 0.5}]
    assert (tmp_path / "plot.png").is_file()
