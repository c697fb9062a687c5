// One generic kernel every rule shares: storing rows in place into a donated
// table, for any element size (float32, bfloat16, float16 and their bits), called
// from XLA through its FFI (`kernels.store_rows`).
//
// XLA:CPU has no 16-bit float scatter: it converts the whole table to float32
// and back around one, or makes two same-width copies of it around a scatter of
// the bits (`bcoo.set_rows`). This kernel writes the given rows' bytes into the
// table, which XLA aliases to its output: a row set is the same bits on every
// path, so it equals the XLA ops bit for bit by construction, and a donated
// step copies no table. The values are computed by XLA (the rule's math, the
// apply's sum and its rounding); this only moves them.

#include <cstdint>
#include <cstring>

#include "ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace {

// `out[rows[i]] = values[i]`, rows out of range dropped (BCOO padding).
// `rows_unique` promises no in-range row repeats; otherwise a repeated row keeps
// its last entry, as XLA's scatter does on one thread (`ForEachEntryRow`).
ffi::Error StoreRowsImpl(ffi::Buffer<ffi::S32> rows, ffi::AnyBuffer values, ffi::AnyBuffer table,
                         int64_t num_rows, bool rows_unique, ffi::ThreadPool pool,
                         ffi::Result<ffi::AnyBuffer> out) {
  if (values.element_type() != table.element_type()) {
    return ffi::Error::InvalidArgument("values must have the table's dtype");
  }
  const int64_t nse = static_cast<int64_t>(rows.element_count());
  const int64_t row_size = RowSize(table.element_count(), num_rows);
  if (row_size < 0) return ffi::Error::InvalidArgument("table must hold num_rows rows");
  if (static_cast<int64_t>(values.element_count()) != nse * row_size) {
    return ffi::Error::InvalidArgument("values must hold nse rows of the table's row size");
  }
  const int64_t row_bytes =
      num_rows == 0 ? 0 : static_cast<int64_t>(table.size_bytes()) / num_rows;
  char* t = static_cast<char*>(out->untyped_data());
  if (t != table.untyped_data()) std::memcpy(t, table.untyped_data(), table.size_bytes());
  const char* val = static_cast<const char*>(values.untyped_data());
  ForEachEntryRow(
      pool, rows.typed_data(), nse, num_rows, row_size, rows_unique, [](int64_t) {},
      [&](int64_t i, int64_t row) {
        std::memcpy(t + row * row_bytes, val + i * row_bytes, row_bytes);
      });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(OsaStoreRows, StoreRowsImpl,
                              RowsIntoTableBinding()
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::AnyBuffer>());
