"""Registers, spills and shared memory of a kernel module, without a GPU.

Compiles cuda/<module>.cu the way the backend does (cuda/common.cuh prepended, NVRTC, sm_90,
C++17), then assembles the PTX with ptxas -v. Use it before spending GPU time on a kernel
change: a build that crosses a register budget (e.g. 128 for two 256-thread blocks per SM)
changes occupancy, which the bench then shows as a slowdown.

  python scripts/kernel_regs.py gemv --define GEMV_STORAGE_bf16 --only _r1_
  python scripts/kernel_regs.py attention --only attn_decode
  python scripts/kernel_regs.py attention_mma --cubin /tmp/after.cubin   # then cmp with a stash's

Needs libnvrtc (the NVIDIA wheels of a torch install ship it: site-packages/nvidia/cu13/lib)
and a ptxas (triton ships one). NVRTC may emit a newer PTX ISA than that ptxas reads; the
version line is lowered to the ptxas's, which is fine for kernels that use no newer instruction.
"""
import argparse, ctypes, glob, os, re, subprocess, sys, sysconfig, tempfile

site = sysconfig.get_paths()["purelib"]
ap = argparse.ArgumentParser()
ap.add_argument("module", help="cuda/<module>.cu")
ap.add_argument("--define", action="append", default=[], help="NAME or NAME=VALUE, prepended as #define")
ap.add_argument("--only", default="", help="report kernels whose name contains this")
ap.add_argument("--arch", default="sm_90")
ap.add_argument("--cubin", help="also keep the assembled cubin here (to compare two trees byte for byte)")
ap.add_argument("--nvrtc", default=next(iter(sorted(glob.glob(f"{site}/nvidia/cu*/lib/libnvrtc.so.*[0-9]"))), None))
ap.add_argument("--ptxas", default=next(iter(glob.glob(f"{site}/triton/backends/nvidia/bin/ptxas")), None))
args = ap.parse_args()
if not args.nvrtc or not args.ptxas:
    sys.exit("need --nvrtc and --ptxas (none found in this Python's site-packages)")
repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
defines = "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in args.define)
src = open(f"{repo}/cuda/common.cuh").read() + "\n" + defines + open(f"{repo}/cuda/{args.module}.cu").read()

lib = ctypes.CDLL(args.nvrtc)
prog = ctypes.c_void_p()
if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f"{args.module}.cu".encode(), 0, None, None):
    sys.exit("nvrtcCreateProgram failed")
opts = [f"--gpu-architecture={args.arch}".encode(), b"--std=c++17"]
if lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)):
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    sys.exit(log.value.decode())
n = ctypes.c_size_t()
lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
ptx = ctypes.create_string_buffer(n.value)
lib.nvrtcGetPTX(prog, ptx)

version = subprocess.run([args.ptxas, "--version"], capture_output=True, text=True).stdout
isa = {"12.8": "8.7", "12.9": "8.8"}.get((re.findall(r"release (\d+\.\d+)", version) or ["12.9"])[0], "8.8")
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "module.ptx")
    with open(path, "wb") as f:
        f.write(re.sub(rb"\.version \d+\.\d+", f".version {isa}".encode(), ptx.value, count=1))
    out = subprocess.run([args.ptxas, f"-arch={args.arch}", "-v", path, "-o", os.path.join(tmp, "m.cubin")],
                         capture_output=True, text=True)
    if args.cubin and not out.returncode:
        import shutil
        shutil.copyfile(os.path.join(tmp, "m.cubin"), args.cubin)
if out.returncode:
    sys.exit(out.stderr)
rows, kernel, spill = [], None, ""
for line in out.stderr.splitlines():
    if "Compiling entry function" in line:
        kernel, spill = line.split("'")[1], ""
    elif "spill" in line:
        spill = line.split(":", 1)[-1].strip()
    elif "registers" in line and kernel and args.only in kernel:
        regs = re.search(r"Used (\d+) registers", line).group(1)
        smem = (re.search(r"(\d+) bytes smem", line) or [None, "0"])[1]
        rows.append((kernel, int(regs), int(smem), spill))
print(f"{'kernel':<32} {'regs':>5} {'smem B':>7}  spills")
for k, r, s, sp in sorted(rows):
    spilled = int((re.search(r"(\d+) bytes spill stores", sp) or [None, "0"])[1])
    print(f"{k:<32} {r:>5} {s:>7}  {sp if spilled else '-'}")
