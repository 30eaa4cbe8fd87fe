// Python bindings of laya::Router. Private: the public class is laya_router.CppRouter, which
// turns this module's NoRouteError into laya_core.router.NoRouteError.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "router.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_router_ext, m) {
    m.doc() = "C++ least-outstanding-requests router (private; use laya_router.CppRouter).";

    // The extension must not import laya_core (the stub is generated without it), so it raises
    // its own LookupError subclass and the Python wrapper re-raises the core's type.
    nb::exception<laya::NoRoute>(m, "NoRouteError", PyExc_LookupError);

    // KeyError(replica), exactly what PythonRouter's dict look-ups raise.
    nb::register_exception_translator([](const std::exception_ptr& error, void*) {
        try {
            std::rethrow_exception(error);
        } catch (const laya::UnknownReplica& unknown) {
            PyErr_SetObject(PyExc_KeyError, nb::int_(unknown.replica).ptr());
        }
    });

    // The GIL stays held: a call is a few map look-ups, cheaper than releasing it. No Python code
    // runs while the mutex is held, so the two locks cannot deadlock; the mutex is what keeps the
    // tables safe once the GIL is released or absent (free-threaded builds).
    nb::class_<laya::Router>(m, "Router",
                             "Least outstanding requests; ties round robin in insertion order.")
        .def(nb::init<>())
        .def("add_replica", &laya::Router::add_replica, "model"_a, "replica"_a, "weight"_a = 1,
             "Add ``replica`` to the pool of ``model`` (state UP, no outstanding requests).")
        .def("remove_replica", &laya::Router::remove_replica, "replica"_a,
             "Forget ``replica``; unknown ids raise ``KeyError``.")
        .def("set_state", &laya::Router::set_state, "replica"_a, "state"_a,
             "Mark a replica up (0), draining (1) or down (2).")
        .def("route", &laya::Router::route, "model"_a,
             "Choose a replica of ``model`` and count one more outstanding request on it.")
        .def("release", &laya::Router::release, "replica"_a,
             "One request routed to ``replica`` finished.")
        .def("outstanding", &laya::Router::outstanding, "replica"_a,
             "Requests routed to ``replica`` and not yet released.");
}
