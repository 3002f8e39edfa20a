// How the normal combine moves a private x between ranks of a node: read by its owners
// through cross-memory attach (cma.h), or staged into shared memory by its rank.
#pragma once

namespace moekit::ep::detail {

// Which is faster depends on the host: on the 2-vCPU AMX Xeon the owners' kernel copies out
// of the experts' x won (combine 13.4-15.3 ms against 17.1-18.8 staged), on the 2-vCPU Zen 3
// VM they lost (28-48 ms against 13-24: the kernel copy moved 3.4-7 GB/s there, and the
// reduction beside it slowed down too). So where cma is available and nothing forces a
// path, the buffer's first combines that have a private x somewhere try both and keep the
// cheaper (docs/EP.md, "Combine from private memory"):
// - counted calls 0 and 1 (cma, then staged) warm up and are not measured;
// - calls 2 to 5 alternate (cma, staged, ...), and each rank measures its own cost: the
//   time from the start of its part (mapping new segments, staging, the wait for the other
//   ranks' staging) to the end of its reduction, per row of its x plus token it reduces;
// - each rank publishes that cost in the first round of every later combine, and the next
//   counted call adds up what every rank published, so every rank reaches the same verdict
//   at call 6: cma if its two calls cost less than the two staged ones (a tie: staged).
// A call counts when some rank holds rows of x in private memory. Forcing cma
// (MOEKIT_EP_CMA=1) takes effect only where every rank asks for it (agreed at construction).
// Both paths give the same bits (the same rows summed in the same order), so the choice
// changes only the time.
struct CombineReadChoice {
  static constexpr int kProbeCalls = 6;
  int calls = 0;           // counted combines so far, while probing
  int decided = -1;        // -1 probing; else 1 = cma, 0 = staged
  bool last_cma = false;   // the path of the call just chosen
  bool measuring = false;  // whether that call's cost is added up
  double cost[2] = {};     // node-wide cost of the measured calls, [staged, cma]
  double my_cost = 0;      // this rank's cost of its previous measured call (0: none)

  // The path of the next counted call (true: cma), given the node-wide cost of the previous
  // one (the sum of what every rank published).
  bool next(double previous_cost) {
    if (decided < 0) {
      const int k = calls++;
      if (k >= 3) cost[last_cma ? 1 : 0] += previous_cost;  // (of call k - 1: calls 2 to 5)
      if (k == kProbeCalls) decided = cost[1] < cost[0] ? 1 : 0;
      last_cma = k % 2 == 0;
      measuring = k >= 2;
    }
    if (decided >= 0) last_cma = decided == 1, measuring = false;
    return last_cma;
  }
  bool measured() const { return measuring; }
};

// For tests: every later measured combine of this process reports these costs (read, staged)
// instead of its timing, so that ranks can be given costs that disagree; (0, 0) restores
// the timing (intranode.cpp).
void set_combine_costs_for_testing(double read, double staged);
double combine_cost_for_testing(bool read);  // 0: none set

}  // namespace moekit::ep::detail
