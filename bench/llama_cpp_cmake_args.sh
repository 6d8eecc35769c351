#!/bin/sh
# CMAKE_ARGS for llama-cpp-python's build on this machine (`make bench-peers`): this CPU's
# instruction sets named one by one (GGML_NATIVE off), AMX always off. ggml's native build
# on an Intel Xeon with AMX dies at its first token with a general protection fault on
# ldtilecfg (it never asks the kernel for the tile state); on an AVX2-only CPU the AVX-512
# switches stay off.
#
# CPU_FLAGS, when set, stands for /proc/cpuinfo's flags line: `CPU_FLAGS="avx avx2 fma f16c
# bmi2"` gives the build an AVX2-only CPU gets, to check that build on a CPU with more.
flags=${CPU_FLAGS:-$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null)}
has() { case " $flags " in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
printf '%s' "-DGGML_NATIVE=OFF -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2)"
printf '%s' " -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c) -DGGML_BMI2=$(has bmi2)"
printf '%s' " -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi)"
printf '%s' " -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)"
printf '%s' " -DGGML_AVX_VNNI=$(has avx_vnni)"
printf '%s\n' " -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
