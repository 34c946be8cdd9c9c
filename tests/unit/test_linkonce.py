"""kiln.runtime.linkonce: a parallel kernel compiled through kiln's pipeline has its loops' two
wrapper libraries only linked (not optimized and emitted on their own), computes what numba's own
pipeline computes, and is saved to and loaded from numba's disk cache like any kernel."""

import subprocess
import sys
import textwrap

import numpy as np
from numba import njit, prange

from kiln.runtime.pipeline import kernel_pipeline


def _row_max(x, out):  # a reduction with NaN kept, as the codegen writes one
    for i in prange(x.shape[0]):
        m = np.float32(-np.inf)
        nan = False
        for j in range(x.shape[1]):
            v = x[i, j]
            m = v if v > m else m
            nan = nan | (v != v)
        out[i] = np.float32(np.nan) if nan else m


def test_wrappers_are_only_linked_and_the_values_are_numbas(monkeypatch):
    import kiln.runtime.linkonce as linkonce

    linked, real = [], linkonce._finalize_for_linking
    monkeypatch.setattr(linkonce, "_finalize_for_linking", lambda lib: (linked.append(lib.name), real(lib))[1])
    options = dict(parallel=True, error_model="numpy", fastmath={"reassoc", "contract"})
    x = np.random.default_rng(0).standard_normal((96, 64)).astype(np.float32)
    x[5, 7] = np.nan
    want, got = np.empty(96, np.float32), np.empty(96, np.float32)
    njit(**options)(_row_max)(x, want)
    assert linked == []  # numba's own pipeline: untouched
    njit(pipeline_class=kernel_pipeline(), **options)(_row_max)(x, got)
    assert "parallelgufuncwrapper" in linked and any("_GufuncWrapper" in n for n in linked), linked
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got[5]) and got[0] == x[0].max()


def test_a_kernel_compiled_so_is_cached_and_loads_in_a_new_process(tmp_path):
    (tmp_path / "kiln_k_cached.py").write_text(textwrap.dedent('''
        import numpy as np
        from numba import njit, prange
        from kiln.runtime.pipeline import kernel_pipeline

        @njit(cache=True, parallel=True, nogil=True, pipeline_class=kernel_pipeline())
        def k(x, out):
            for i in prange(x.shape[0]):
                s = np.float32(0.0)
                for j in range(x.shape[1]):
                    s += x[i, j] * x[i, j]
                out[i] = s
    '''))
    run = textwrap.dedent('''
        import numpy as np, kiln_k_cached as m
        x = np.arange(64 * 16, dtype=np.float32).reshape(64, 16) / 100
        out = np.empty(64, np.float32)
        m.k(x, out)
        assert np.allclose(out, (x * x).sum(1), rtol=1e-6)
        print(sum(m.k.stats.cache_hits.values()), sum(m.k.stats.cache_misses.values()))
    ''')
    counts = [subprocess.run([sys.executable, "-c", run], cwd=tmp_path, capture_output=True, text=True, check=True,
                             timeout=300).stdout.split() for _ in range(2)]
    assert counts[0] == ["0", "1"] and counts[1][0] != "0", counts  # compiled and saved, then loaded
