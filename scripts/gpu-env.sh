# Sourced by gpu-check.sh and gpu-bench.sh: puts the CUDA libraries the binary loads at run
# time (the driver, NVRTC, cuBLASLt) on LD_LIBRARY_PATH: the toolkit's, then any that
# PyTorch's wheels carry.
libs=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda-*/lib64 /usr/local/cuda/targets/*/lib 2>/dev/null | tr '\n' ':')
libs+=$(python3 - <<'PY' 2>/dev/null
import glob, os
try:
    import nvidia
    print(":".join(sorted({os.path.dirname(p) for d in nvidia.__path__
                           for p in glob.glob(os.path.join(d, "**", "lib*.so*"), recursive=True)})))
except Exception:
    pass
PY
)
libs="${libs%:}"
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+${libs:+:}$LD_LIBRARY_PATH}"
