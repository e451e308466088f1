// mpt._C: small native helpers that Python cannot do portably or race-free.
//
// Written against the plain CPython C API (no torch headers, no pybind11) so the optional
// extension builds in a couple of seconds and never pins a torch ABI.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cerrno>
#include <csignal>

#if defined(__linux__)
#include <sys/prctl.h>
#include <unistd.h>
#endif

namespace {

constexpr const char* kSetParentDeathSignalDoc =
    "set_parent_death_signal($module, signum, expected_parent_pid=-1)\n"
    "--\n"
    "\n"
    "Ask the kernel to send `signum` to this process when its parent dies (Linux\n"
    "prctl(PR_SET_PDEATHSIG)), so workers cannot outlive the launcher that started them.\n"
    "\n"
    "The parent may already have died before the call; the kernel then never signals us.\n"
    "So after the prctl the parent pid is compared with `expected_parent_pid` (the pid the\n"
    "caller captured earlier, ideally the launcher's own pid; -1 means getppid() at entry).\n"
    "Returns False when they differ: the parent is gone and the caller should exit.\n"
    "\n"
    "Caveat: Linux sends the signal when the *thread* that forked us exits, not the whole\n"
    "parent process; launchers must spawn workers from a thread that lives as long as they do.\n"
    "\n"
    "On other platforms this does nothing and returns True.";

PyObject* set_parent_death_signal(PyObject* /*self*/, PyObject* args, PyObject* kwargs) {
  static const char* keywords[] = {"signum", "expected_parent_pid", nullptr};
  int signum = 0;
  int expected_parent_pid = -1;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "i|i:set_parent_death_signal",
                                   const_cast<char**>(keywords), &signum,
                                   &expected_parent_pid)) {
    return nullptr;
  }
  if (signum < 1 || signum >= NSIG) {
    PyErr_Format(PyExc_ValueError,
                 "signum=%d is invalid: not a signal number. Fix: pass one in 1..%d, "
                 "e.g. signal.SIGTERM",
                 signum, NSIG - 1);
    return nullptr;
  }
#if defined(__linux__)
  const pid_t expected = expected_parent_pid == -1 ? getppid() : expected_parent_pid;
  if (prctl(PR_SET_PDEATHSIG, static_cast<unsigned long>(signum), 0UL, 0UL, 0UL) != 0) {
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  // Checked after the prctl: if the parent died before it, we were already reparented.
  return PyBool_FromLong(getppid() == expected);
#else
  (void)expected_parent_pid;
  Py_RETURN_TRUE;
#endif
}

PyMethodDef methods[] = {
    // The void(*)(void) hop is CPython's documented idiom for METH_KEYWORDS functions.
    {"set_parent_death_signal",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(set_parent_death_signal)),
     METH_VARARGS | METH_KEYWORDS, kSetParentDeathSignalDoc},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef_Slot slots[] = {
#if defined(Py_mod_multiple_interpreters)
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#if defined(Py_mod_gil)
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, nullptr},
};

PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "mpt._C",
    "mpt's optional native extension (built from backends/csrc by CMake).",
    0,
    methods,
    slots,
    nullptr,
    nullptr,
    nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__C() { return PyModuleDef_Init(&module_def); }
