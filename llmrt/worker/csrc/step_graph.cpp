// Replays a recorded decode step: the ops one forward called, in order, through the dispatcher, without Python.
//
// llmrt/worker/step_graph.py records the ops (a TorchDispatchMode) and hands each one here with its arguments:
// constants (weights, caches, shapes, scalars) converted once by the op's own schema, and references to the
// values earlier ops returned or to the step's inputs ("slots"). `run` puts the new step's input tensors in
// their slots and calls every op boxed, as torch's own interpreter does: ~0.3 us an op instead of the 1-5 us of
// a Python call, and nothing of the model's module tree.
#include <torch/extension.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <tuple>
#include <vector>

namespace {

struct Instr {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;                       // constants; referenced positions filled at run time
  std::vector<std::pair<int64_t, int64_t>> refs;       // (argument, slot)
  std::vector<std::tuple<int64_t, int64_t, int64_t>> list_refs;  // (argument, element, slot): Tensor[] arguments
  std::vector<std::vector<int64_t>> outs;              // per return: its slot, or one slot per element of a list
};

class StepGraph {
 public:
  explicit StepGraph(int64_t num_slots) : env_(num_slots) {}

  // One op, in call order. `args` are Python values in schema order (None where a reference goes).
  void add(const std::string& name, const std::string& overload, py::list args,
           std::vector<std::pair<int64_t, int64_t>> refs,
           std::vector<std::tuple<int64_t, int64_t, int64_t>> list_refs, std::vector<std::vector<int64_t>> outs) {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const auto& schema = op.schema();
    TORCH_CHECK(args.size() == schema.arguments().size(), name, ": ", args.size(), " arguments for ",
                schema.arguments().size());
    TORCH_CHECK(outs.size() == schema.returns().size(), name, ": ", outs.size(), " return slots for ",
                schema.returns().size());
    Instr in{op, {}, std::move(refs), std::move(list_refs), std::move(outs)};
    // Python numbers where the schema says Tensor (x + 1e-6) become wrapped-number tensors, as in torch's bindings.
    torch::jit::ToIValueAllowNumbersAsTensors numbers_as_tensors(true);
    std::vector<bool> referenced(args.size(), false);
    for (const auto& r : in.refs) referenced.at(r.first) = true;
    for (size_t i = 0; i < args.size(); ++i) {
      in.args.push_back(referenced[i] ? c10::IValue() : torch::jit::toIValue(args[i], schema.arguments()[i].type()));
    }
    for (const auto& r : in.refs) check_slot(r.second);
    for (const auto& r : in.list_refs) {
      check_slot(std::get<2>(r));
      TORCH_CHECK(in.args.at(std::get<0>(r)).isTensorList(), name, ": a list reference into a non-Tensor[] argument");
    }
    for (const auto& o : in.outs)
      for (auto s : o) if (s >= 0) check_slot(s);
    prog_.push_back(std::move(in));
    ns_.push_back(0);
  }

  // The step: `inputs` go to `input_slots`, every op runs, the values in `output_slots` come back.
  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs, const std::vector<int64_t>& input_slots,
                              const std::vector<int64_t>& output_slots) {
    TORCH_CHECK(inputs.size() == input_slots.size(), "one input per input slot");
    py::gil_scoped_release no_gil;
    try {
      return run_program(inputs, input_slots, output_slots);
    } catch (...) {
      for (auto& v : env_) v = c10::IValue();  // a failed op (e.g. a bad slot) keeps nothing of the step alive
      throw;
    }
  }

  int64_t size() const { return static_cast<int64_t>(prog_.size()); }

  // Wall time per op summed over the runs since timing was turned on (ns per op, runs): where a replayed step's
  // time goes, op by op, which no Python-side timer can see. Off by default (two clock reads an op when on).
  void set_timing(bool on) {  // turning it on starts new sums; turning it off keeps them for timings()
    if (on) {
      ns_.assign(prog_.size(), 0);
      runs_ = 0;
    }
    timing_ = on;
  }
  std::pair<std::vector<int64_t>, int64_t> timings() const { return {ns_, runs_}; }

 private:
  std::vector<at::Tensor> run_program(const std::vector<at::Tensor>& inputs, const std::vector<int64_t>& input_slots,
                                      const std::vector<int64_t>& output_slots) {
    for (size_t i = 0; i < inputs.size(); ++i) env_.at(input_slots[i]) = inputs[i];
    torch::jit::Stack stack;
    using clock = std::chrono::steady_clock;
    for (size_t pc = 0; pc < prog_.size(); ++pc) {
      const Instr& in = prog_[pc];
      stack.assign(in.args.begin(), in.args.end());
      for (const auto& r : in.refs) stack[r.first] = env_[r.second];
      if (!in.list_refs.empty()) {
        // A fresh list: the constant one is shared by every run.
        std::vector<int64_t> done;
        for (const auto& r : in.list_refs) {
          int64_t arg = std::get<0>(r);
          if (std::find(done.begin(), done.end(), arg) == done.end()) {
            c10::List<at::Tensor> copy;
            for (const auto& t : in.args[arg].toTensorList()) copy.push_back(t);
            stack[arg] = copy;
            done.push_back(arg);
          }
          auto list = stack[arg].toTensorList();
          list.set(std::get<1>(r), env_[std::get<2>(r)].toTensor());
        }
      }
      const auto t0 = timing_ ? clock::now() : clock::time_point{};
      in.op.callBoxed(&stack);
      if (timing_) ns_[pc] += std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - t0).count();
      for (size_t k = 0; k < in.outs.size(); ++k) {
        const auto& o = in.outs[k];
        if (o.size() == 1 && !stack[k].isTensorList()) {
          if (o[0] >= 0) env_[o[0]] = std::move(stack[k]);
        } else if (!o.empty()) {
          auto list = stack[k].toTensorList();
          TORCH_CHECK(list.size() == o.size(), "a list return changed length between recording and replay");
          for (size_t j = 0; j < o.size(); ++j) if (o[j] >= 0) env_[o[j]] = list.get(j);
        }
      }
    }
    std::vector<at::Tensor> result;
    for (auto s : output_slots) result.push_back(env_.at(s).toTensor());
    for (auto& v : env_) v = c10::IValue();  // release the step's activations
    if (timing_) ++runs_;
    return result;
  }

  void check_slot(int64_t s) const { TORCH_CHECK(s >= 0 && s < static_cast<int64_t>(env_.size()), "slot ", s); }

  std::vector<Instr> prog_;
  std::vector<c10::IValue> env_;
  bool timing_ = false;
  std::vector<int64_t> ns_;  // per op, one entry added with it
  int64_t runs_ = 0;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<StepGraph>(m, "StepGraph")
      .def(py::init<int64_t>())
      .def("add", &StepGraph::add)
      .def("run", &StepGraph::run)
      .def("set_timing", &StepGraph::set_timing)
      .def("timings", &StepGraph::timings)
      .def("__len__", &StepGraph::size);
}
