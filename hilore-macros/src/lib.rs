//! `#[recovery_unit]`: marks a function whose saved state HiLoRe manages as one unit.
//!
//! Use it through `hilore_runtime::recovery_unit`; see that crate for the semantics. The
//! macro runs as a pipeline, one module per phase: [`attr`] parses the arguments, [`ast`]
//! reads the signature, [`valid`] checks what can be checked at compile time, [`expand`]
//! generates the descriptor, its registration, the recompute closure and the wrapper.
//! Every error carries the span of the user's tokens; all errors are reported at once, and
//! on error the original function is still emitted so the rest of the crate type-checks.

mod ast;
mod attr;
mod ctxt;
mod expand;
mod valid;

use proc_macro::TokenStream;

/// Marks a function as a recovery unit. Arguments:
///
/// - `cost = <expr>` (required): an estimate of the unit's forward cost (e.g. FLOPs),
///   evaluated on the live inputs; may use `?`.
/// - `deterministic`: the body replays bit-identically, so the unit may be recomputed.
///   The body is checked for obvious nondeterminism (thread/OS RNGs, unseeded tensor RNGs,
///   clocks, randomly ordered hash maps).
/// - `name = "..."`: the unit's name in plans and reports (default: the function's name).
/// - `codecs = ["bf16", ...]`: the only codecs the Compress fidelity may use.
///
/// The function takes `&self` (or no receiver), the tape context `cx: &mut Cx`, and inputs
/// that are `Replayable`: tape values (`&Var`, `Var`, `&[Var]`), `Copy` configuration, or
/// replayable metadata (`&Packing`, `&RopeTables`). It returns `Result<T>` with `T` a
/// `UnitOutput` (`Var`, a tuple of them, `Vec<Var>`).
///
/// The macro ties `&self` and `Cx` to one model lifetime `'m` (the recompute closure
/// borrows the module). In a trait impl, whose signature must match the trait's, write
/// that lifetime in the trait and the impl alike:
/// `fn forward<'m>(&'m self, cx: &mut Cx<'m>, x: &Var) -> Result<Var>`; the macro then
/// adds nothing to the signature. Where the trait leaves it out, the build fails with
/// "method `forward__in_a_trait_impl_a_recovery_unit_needs_the_model_lifetime_written_in_the_trait_and_the_impl__…`
/// is not a member of trait", next to rustc's own signature mismatch.
#[proc_macro_attribute]
pub fn recovery_unit(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::recovery_unit(args.into(), item.into()).into()
}
