"""The benchmarks' library (bench/README.md): what the entry points in bench/ share. Not a benchmark itself; the
entry points put bench/ on sys.path and import it as `lib`. `lib.common` first where torch is loaded: it sets the
multicast-off environment before NCCL reads it."""
