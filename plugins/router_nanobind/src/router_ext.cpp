// Python bindings of laya::Router. Private: the public class is laya_router.CppRouter.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#include "router.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// laya_core.routing.router.NoRouteError, imported on the first no-route error rather than at import:
// the stub is generated in a build environment without laya_core. Raising the core's type here
// spares CppRouter a Python wrapper around route(), which would cost about 0.3 µs per call.
PyObject* no_route_error() {
    static PyObject* type = nullptr;  // one reference kept for the life of the process
    if (type == nullptr) {
        try {
            nb::object core = nb::module_::import_("laya_core.routing.router");
            type = nb::object(core.attr("NoRouteError")).release().ptr();
        } catch (const nb::python_error&) {
            return PyExc_LookupError;  // laya_core is a dependency; this is only a fallback
        }
    }
    return type;
}

}  // namespace

NB_MODULE(_router_ext, m) {
    m.doc() = "C++ router tables and policies (private; use laya_router.CppRouter).";

    nb::register_exception_translator([](const std::exception_ptr& error, void*) {
        try {
            std::rethrow_exception(error);
        } catch (const laya::UnknownReplica& unknown) {
            // KeyError(replica), exactly what PythonRouter's dict look-ups raise.
            PyErr_SetObject(PyExc_KeyError, nb::int_(unknown.replica).ptr());
        } catch (const laya::NoRoute& no_route) {
            PyErr_SetString(no_route_error(), no_route.what());
        }
    });

    // The GIL stays held in every method; measured, not assumed. tools/benchmark_router.py
    // --requests 20000 (prefix policy) on the 2-core dev machine, two runs each:
    //   GIL held (this):         8 threads avg 0.31-0.32 µs, p99 0.59-0.61 µs;
    //                           64 threads avg 0.33-0.42 µs, p99 0.69-0.80 µs.
    //   call_guard<gil_scoped_release> on route and release:
    //                            8 threads avg 2.0 µs,       p99 0.74-4.8 µs;
    //                           64 threads avg 14-68 µs,     p99 2.5-2400 µs.
    // The table work is about 0.1 µs. Releasing the GIL adds ~20 ns per call (route + release
    // 125 -> 169 ns in one thread), and taking it back means queueing behind other Python
    // threads, which puts multi-millisecond waits inside the timed call; nothing runs in
    // parallel to pay for it. No Python code runs while a router lock is held, so the GIL and
    // those locks cannot deadlock; the locks keep the tables safe where there is no GIL.
    nb::class_<laya::Router>(m, "Router", "Replica tables and routing policies, in C++.")
        .def(nb::init<std::int64_t, std::optional<double>, std::int64_t, std::int64_t>(),
             nb::kw_only(), "session_capacity"_a = 65'536, "session_ttl_s"_a = nb::none(),
             "prefix_capacity"_a = 65'536, "imbalance_threshold"_a = 2)
        .def("add_replica", &laya::Router::add_replica, "model"_a, "replica"_a, "weight"_a = 1,
             "Add ``replica`` to the pool of ``model`` (state UP, no outstanding requests).")
        .def("remove_replica", &laya::Router::remove_replica, "replica"_a,
             "Forget ``replica``; unknown ids raise ``KeyError``.")
        .def("set_state", &laya::Router::set_state, "replica"_a, "state"_a,
             "Mark a replica up (0), draining (1) or down (2).")
        .def("add_alias", &laya::Router::add_alias, "alias"_a, "model"_a,
             "Route requests for ``alias`` to the pool of ``model``.")
        .def("set_policy", &laya::Router::set_policy, "model"_a, "policy"_a,
             "imbalance_threshold"_a = nb::none(),
             "Choose how ``model`` routes: least_outstanding, round_robin, session or prefix.")
        .def("route", &laya::Router::route, "model"_a, "session"_a = nb::none(),
             "prefix"_a = nb::tuple(),
             "Choose a replica of ``model`` and count one more outstanding request on it.")
        .def("release", &laya::Router::release, "replica"_a,
             "One request routed to ``replica`` finished.")
        .def("outstanding", &laya::Router::outstanding, "replica"_a,
             "Requests routed to ``replica`` and not yet released.");
}
