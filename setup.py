"""Build script: compiles the Cython hot path in ``motor/_fast``.

Options (asyncpg style), through environment variables because PEP 517 front ends
do not pass setup.py flags:

* ``MOTOR_DEBUG=1``      compile with ``-DMOTOR_DEBUG=1`` (invariant checks, debug counters)
* ``MOTOR_ANNOTATE=1``   write Cython's annotated HTML next to each ``.pyx``
"""
import glob
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("MOTOR_DEBUG", "0") == "1"
ANNOTATE = os.environ.get("MOTOR_ANNOTATE", "0") == "1"

extra_compile_args = ["-O3", "-Wall", "-Wno-unused-function", "-Wno-unreachable-code"]
define_macros = [("MOTOR_DEBUG", "1" if DEBUG else "0"),
                 ("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]

extensions = [
    Extension(
        "motor._fast." + os.path.splitext(os.path.basename(pyx))[0],
        [pyx],
        include_dirs=[numpy.get_include(), "motor/_fast"],
        extra_compile_args=extra_compile_args,
        define_macros=define_macros,
    )
    for pyx in sorted(glob.glob("motor/_fast/*.pyx"))
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        annotate=ANNOTATE,
        compiler_directives={
            "boundscheck": DEBUG,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": DEBUG,
            "embedsignature": True,
        },
    ),
)
