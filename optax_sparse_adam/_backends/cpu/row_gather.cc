// The generic kernel before a rule's math: a gradient's rows coalesced and the
// rows of any number of tables gathered at them, in one pass, for any rule and
// any table dtype (`kernels.coalesce_and_gather`). The rule's math then runs as
// XLA ops on the gathered block, and the generic store (`row_store.cc`) writes
// its rows back in place: no per-rule C++.
//
// XLA:CPU sorts, searches and gathers element by element; this does the
// coalescing of `ffi_common.h` (a stable radix sort, each row's entries summed in
// input order from +0.0, as `coalesce.coalesce_and_gather_rows` sums them) and
// copies each table's row bytes at each distinct row, zeros at padding slots (as
// `bcoo.gather_rows` fills them): XLA's bits by construction.

#include <cstdint>
#include <cstring>
#include <vector>

#include "ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace {

struct GatheredTable {
  const char* rows;  // the table, `num_rows` rows of `row_bytes`
  char* out;         // `nse` rows of `row_bytes`
  int64_t row_bytes;
};

ffi::Error CoalesceGatherImpl(ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> values,
                              ffi::RemainingArgs tables, int64_t num_rows, ffi::ThreadPool pool,
                              ffi::Result<ffi::Buffer<ffi::S32>> out_rows,
                              ffi::Result<ffi::Buffer<ffi::F32>> out_values,
                              ffi::RemainingRets gathered) {
  const int64_t nse = static_cast<int64_t>(rows.element_count());
  const int64_t row_size =
      nse == 0 ? 0 : static_cast<int64_t>(values.element_count()) / nse;
  if (nse == 0 || row_size == 0 || row_size * nse != static_cast<int64_t>(values.element_count())) {
    return ffi::Error::InvalidArgument("values must hold nse > 0 rows of at least one value");
  }
  if (num_rows <= 0 || tables.size() != gathered.size()) {
    return ffi::Error::InvalidArgument("one gathered output per table, num_rows > 0");
  }
  std::vector<GatheredTable> ts;
  for (size_t k = 0; k < tables.size(); ++k) {
    auto table = tables.get<ffi::AnyBuffer>(k);
    auto out = gathered.get<ffi::AnyBuffer>(k);
    if (!table.has_value() || !out.has_value()) {
      return ffi::Error::InvalidArgument("tables and outputs must be buffers");
    }
    if (RowSize(table->element_count(), num_rows) < 0) {
      return ffi::Error::InvalidArgument("each table must hold num_rows rows");
    }
    const int64_t row_bytes = static_cast<int64_t>(table->size_bytes()) / num_rows;
    if (static_cast<int64_t>((*out)->size_bytes()) != nse * row_bytes) {
      return ffi::Error::InvalidArgument("each output must hold nse rows of its table");
    }
    ts.push_back({static_cast<const char*>(table->untyped_data()),
                  static_cast<char*>((*out)->untyped_data()), row_bytes});
  }
  int32_t* r = out_rows->typed_data();
  float* sums = out_values->typed_data();
  auto prefetch = [&](int64_t row) {
    for (const GatheredTable& t : ts) PrefetchRow(t.rows + row * t.row_bytes, t.row_bytes);
  };
  // `g` is the distinct row's slot in `sums`: its position gives the slot.
  auto gather = [&](int64_t row, int64_t, float* g) {
    const int64_t slot = (g - sums) / row_size;
    for (const GatheredTable& t : ts) {
      std::memcpy(t.out + slot * t.row_bytes, t.rows + row * t.row_bytes, t.row_bytes);
    }
  };
  CoalescedRowsStep(rows.typed_data(), nse, values.typed_data(), num_rows, row_size, pool, r,
                    sums, prefetch, gather);
  for (int64_t s = nse - 1; s >= 0 && r[s] >= num_rows; --s) {  // padding slots: zeros
    for (const GatheredTable& t : ts) std::memset(t.out + s * t.row_bytes, 0, t.row_bytes);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OsaCoalesceGather, CoalesceGatherImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Attr<int64_t>("num_rows")
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .RemainingRets());
