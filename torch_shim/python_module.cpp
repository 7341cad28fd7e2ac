// dtrain_torch._C: the Python face of ProcessGroupDtrain (process_group_dtrain.h), imported by
// dtrain_torch/__init__.py, which registers the "dtrain" backend and the "dtrain://" init method.
//
// Contract:
//  * ProcessGroupDtrain and DtrainStore are subclasses of torch.distributed's ProcessGroup and
//    Store (the same Python types torch's own backends return), so torch.distributed's
//    functions, DDP and user code take them unchanged.
//  * Every call that may block (creating a group, connecting a store) releases the GIL.
//  * dtrain's errors reach Python as dtrain_torch.<Kind> (TimeoutError, BackendError,
//    DesyncError, NetworkError, InvalidArgument, NotSupportedError, MemberLostError), each a
//    subclass of RuntimeError (what torch's backends raise, so `except RuntimeError` keeps
//    working), whose message is dtrain's message. The translator is pybind11's, shared with
//    torch's own bindings (Work.wait, the collectives), since both use one pybind11 internals.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "common/errors.h"
#include "process_group/process_group.h"
#include "torch_shim/process_group_dtrain.h"

namespace py = pybind11;
using dt::torch_shim::DtrainStore;
using dt::torch_shim::ProcessGroupDtrain;

namespace {

// pybind11 tries translators in reverse order of registration: the subclasses, registered after
// dt::Error's, are tried before it, whose catch would take every one of them.
template <typename E>
void registerError(py::module_& m, const char* name, py::handle base) {
  static py::exception<E> type(m, name, base);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const E& e) {
      PyErr_SetString(type.ptr(), e.what());
    }
  });
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "dtrain's process group as a torch.distributed backend (see docs/torch.md)";
  py::module_ c10d = py::module_::import("torch._C._distributed_c10d");

  static py::exception<dt::Error> error(m, "Error", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const dt::Error& e) {
      PyErr_SetString(error.ptr(), e.what());
    }
  });
  registerError<dt::TimeoutError>(m, "TimeoutError", error);
  registerError<dt::NetworkError>(m, "NetworkError", error);
  registerError<dt::BackendError>(m, "BackendError", error);
  registerError<dt::DesyncError>(m, "DesyncError", error);
  registerError<dt::InvalidArgument>(m, "InvalidArgument", error);
  registerError<dt::NotSupportedError>(m, "NotSupportedError", error);
  registerError<dt::MemberLostError>(m, "MemberLostError", error);

  py::class_<DtrainStore, c10::intrusive_ptr<DtrainStore>>(m, "DtrainStore", c10d.attr("Store"),
                                                           "dtrain's store (TcpStore, EtcdStore) as a torch Store")
      .def_static("connect", &dt::torch_shim::connectLauncherStore, py::arg("rank"), py::arg("world_size"),
                  py::arg("timeout"), py::call_guard<py::gil_scoped_release>(),
                  "The launcher's store (dtrun's, etcd, or rank 0's at MASTER_ADDR:MASTER_PORT)");

  py::class_<ProcessGroupDtrain, c10::intrusive_ptr<ProcessGroupDtrain>>(m, "ProcessGroupDtrain",
                                                                         c10d.attr("ProcessGroup"))
      .def_static(
          "create",
          [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
             std::string groupId, std::vector<int64_t> globalRanks) {
            dt::torch_shim::CreateOptions options;
            options.groupId = std::move(groupId);
            options.globalRanks = std::move(globalRanks);
            options.timeout = timeout;
            return ProcessGroupDtrain::create(store, rank, size, std::move(options));
          },
          py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("group_id") = "0",
          py::arg("global_ranks") = std::vector<int64_t>{}, py::call_guard<py::gil_scoped_release>())
      .def("is_broken", [](const ProcessGroupDtrain& pg) { return pg.brokenCause() != nullptr; })
      .def("broken_cause",
           [](const ProcessGroupDtrain& pg) -> py::object {
             auto cause = pg.brokenCause();
             if (!cause) return py::none();
             try {
               std::rethrow_exception(cause);
             } catch (const std::exception& e) {
               return py::str(dt::describe(e));
             }
           })
      .def("abort", &ProcessGroupDtrain::abort, py::arg("reason"),
           "Fails every op in flight or queued, and every later one, with `reason`")
      .def("dtrain_backend", [](ProcessGroupDtrain& pg) {
        return pg.group().backendFor(dt::Device::cpu()).name();
      });
}
