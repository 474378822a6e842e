//! A typed view of the annotated function's signature.

use crate::ctxt::Ctxt;
use syn::{FnArg, Ident, ItemFn, Pat, ReturnType, Type};

/// How the unit sees one parameter.
pub(crate) enum ParamRole {
    /// The tape context `&mut Cx` (at most one).
    Context,
    /// A replayable input taken by reference: `&U`; `U` must be `Replayable`.
    ByRef(Type),
    /// A replayable input taken by value: `T` must be `ReplayOwned`.
    ByValue(Type),
}

pub(crate) struct Param {
    pub ident: Ident,
    pub pat: Pat,
    pub ty: Type,
    pub role: ParamRole,
    pub is_tape: bool,
}

pub(crate) struct Signature {
    /// Whether the function takes `&self`.
    pub receiver: bool,
    pub params: Vec<Param>,
    /// The lifetime written on `Cx<'a>`, if any.
    pub cx_lifetime: Option<syn::Lifetime>,
    /// `T` in the return type `Result<T>` / `Result<T, E>`, if written that way.
    pub output: Option<Type>,
}

/// Whether `ty` is `&mut Cx` / `&mut path::Cx<..>`; returns the lifetime argument of `Cx`.
fn as_cx(ty: &Type) -> Option<Option<Option<syn::Lifetime>>> {
    let Type::Reference(r) = ty else { return None };
    let Type::Path(p) = &*r.elem else { return None };
    let last = p.path.segments.last()?;
    if last.ident != "Cx" {
        return None;
    }
    let lt = match &last.arguments {
        syn::PathArguments::AngleBracketed(a) => a.args.iter().find_map(|g| match g {
            syn::GenericArgument::Lifetime(l) if l.ident != "_" => Some(l.clone()),
            _ => None,
        }),
        _ => None,
    };
    Some(if r.mutability.is_some() {
        Some(lt)
    } else {
        None
    })
}

fn mentions_var(ty: &Type) -> bool {
    fn walk(ts: proc_macro2::TokenStream) -> bool {
        ts.into_iter().any(|t| match t {
            proc_macro2::TokenTree::Ident(i) => i == "Var",
            proc_macro2::TokenTree::Group(g) => walk(g.stream()),
            _ => false,
        })
    }
    walk(quote::quote!(#ty))
}

fn contains_impl_trait(ty: &Type) -> bool {
    match ty {
        Type::ImplTrait(_) => true,
        Type::Reference(r) => contains_impl_trait(&r.elem),
        Type::Slice(s) => contains_impl_trait(&s.elem),
        Type::Array(a) => contains_impl_trait(&a.elem),
        Type::Paren(p) => contains_impl_trait(&p.elem),
        Type::Tuple(t) => t.elems.iter().any(contains_impl_trait),
        Type::Path(p) => p.path.segments.iter().any(|s| match &s.arguments {
            syn::PathArguments::AngleBracketed(a) => a.args.iter().any(|g| match g {
                syn::GenericArgument::Type(t) => contains_impl_trait(t),
                _ => false,
            }),
            _ => false,
        }),
        _ => false,
    }
}

pub(crate) fn analyze(cx: &mut Ctxt, f: &ItemFn) -> Signature {
    let sig = &f.sig;
    if let Some(a) = &sig.asyncness {
        cx.error_spanned_by(a, "a recovery unit cannot be `async`: backward re-runs its body synchronously; make it a plain `fn`");
    }
    if let Some(c) = &sig.constness {
        cx.error_spanned_by(
            c,
            "a recovery unit cannot be `const`: it runs ops on the tape; remove `const`",
        );
    }
    if let Some(abi) = &sig.abi {
        cx.error_spanned_by(
            abi,
            "a recovery unit cannot have an `extern` ABI; remove it",
        );
    }
    if let Some(v) = &sig.variadic {
        cx.error_spanned_by(v, "a recovery unit cannot be variadic");
    }
    let mut out = Signature {
        receiver: false,
        params: Vec::new(),
        cx_lifetime: None,
        output: None,
    };
    let mut cx_count = 0;
    let mut cx_not_mut = false;
    for arg in &sig.inputs {
        match arg {
            FnArg::Receiver(r) => {
                if r.colon_token.is_some() {
                    cx.error_spanned_by(r, "a recovery unit method takes `&self`: write `&self`; other receiver types (`self: Rc<Self>`, ...) are not supported");
                } else if r.reference.is_none() {
                    cx.error_spanned_by(r, "a recovery unit cannot take `self` by value: the module must outlive the tape that recomputes it; take `&self`");
                } else if r.mutability.is_some() {
                    cx.error_spanned_by(r, "a recovery unit cannot take `&mut self`: its body runs again on recompute, so it must not mutate the module; take `&self` and keep mutable state (counters, caches) outside the unit");
                } else {
                    out.receiver = true;
                }
            }
            FnArg::Typed(pt) => {
                let ident = match &*pt.pat {
                    Pat::Ident(pi) if pi.by_ref.is_none() && pi.subpat.is_none() => {
                        pi.ident.clone()
                    }
                    other => {
                        cx.error_spanned_by(other, "unsupported parameter pattern in a recovery unit: bind each parameter to a plain name (`x: &Var`)");
                        continue;
                    }
                };
                let ty = (*pt.ty).clone();
                if let Some(lt) = as_cx(&ty) {
                    match lt {
                        Some(lt) => {
                            cx_count += 1;
                            if cx_count > 1 {
                                cx.error_spanned_by(
                                    &pt.ty,
                                    "a recovery unit takes the tape context `&mut Cx` once",
                                );
                            }
                            out.cx_lifetime = lt;
                            out.params.push(Param {
                                ident,
                                pat: (*pt.pat).clone(),
                                ty,
                                role: ParamRole::Context,
                                is_tape: false,
                            });
                        }
                        None => {
                            cx_not_mut = true;
                            cx.error_spanned_by(&pt.ty, "the tape context must be `&mut Cx`: a unit records its ops on the tape; write `cx: &mut Cx`")
                        }
                    }
                    continue;
                }
                if contains_impl_trait(&ty) {
                    cx.error_spanned_by(&pt.ty, "a recovery unit cannot take `impl Trait` parameters: the recompute closure needs a nameable type; use a generic parameter `T: Trait`");
                    continue;
                }
                if let Some(inner) = option_of_reference(&ty) {
                    cx.error_spanned_by(&pt.ty, format!("`{ident}: Option<&{inner}>` cannot be an input of a recovery unit: the recompute keeps its inputs after the forward returns, and a borrowed value inside an `Option` cannot be kept; keep it in the module (a field `Option<{inner}>` read through `&self`, as a bias usually is), or pass `&[{inner}]` with zero or one element"));
                    continue;
                }
                let role = match &ty {
                    Type::Reference(r) if r.mutability.is_some() => {
                        cx.error_spanned_by(&pt.ty, format!("`{ident}` is taken by `&mut`: a recovery unit's body runs again on recompute, so it must not mutate its inputs; take it by `&` (or by value if it is `Copy`), or keep the mutable state outside the unit"));
                        continue;
                    }
                    Type::Reference(r) => ParamRole::ByRef((*r.elem).clone()),
                    _ => ParamRole::ByValue(ty.clone()),
                };
                out.params.push(Param {
                    is_tape: mentions_var(&ty),
                    ident,
                    pat: (*pt.pat).clone(),
                    ty,
                    role,
                });
            }
        }
    }
    if cx_count == 0 && !cx_not_mut {
        cx.error_spanned_by(&sig.ident, format!("`{}` takes no tape context: a recovery unit records its ops on the tape, add a parameter `cx: &mut Cx`", sig.ident));
    }
    let ok_ret = match &sig.output {
        ReturnType::Type(_, ty) => match &**ty {
            Type::Path(p) => p.path.segments.last().is_some_and(|s| s.ident == "Result"),
            _ => false,
        },
        ReturnType::Default => false,
    };
    if let ReturnType::Type(_, ty) = &sig.output {
        if contains_impl_trait(ty) {
            cx.error_spanned_by(ty, "a recovery unit cannot return `impl Trait`: the recompute closure needs a nameable output type; name it (`-> Result<Var>`, `-> Result<(Var, Var)>`)");
        } else if ok_ret {
            out.output = result_ok_type(ty);
        }
    }
    if !ok_ret {
        let msg = "a recovery unit must return `Result<...>` of its output tape values: write `-> Result<Var>` (or `Result<(Var, Var)>`, ...); fidelity and recompute errors surface through it";
        match &sig.output {
            ReturnType::Type(_, ty) => cx.error_spanned_by(ty, msg),
            ReturnType::Default => cx.error_spanned_by(&sig.ident, msg),
        }
    }
    out
}

/// `T` in `Result<T>` / `path::Result<T, E>`.
fn result_ok_type(ty: &Type) -> Option<Type> {
    let Type::Path(p) = ty else { return None };
    let syn::PathArguments::AngleBracketed(a) = &p.path.segments.last()?.arguments else {
        return None;
    };
    a.args.iter().find_map(|g| match g {
        syn::GenericArgument::Type(t) => Some(t.clone()),
        _ => None,
    })
}

/// `T` rendered, when `ty` is `Option<&T>` (any path ending in `Option`).
fn option_of_reference(ty: &Type) -> Option<String> {
    let Type::Path(p) = ty else { return None };
    let last = p.path.segments.last()?;
    if last.ident != "Option" {
        return None;
    }
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    match args.args.first()? {
        syn::GenericArgument::Type(Type::Reference(r)) if r.mutability.is_none() => {
            let elem = &r.elem;
            Some(quote::quote!(#elem).to_string().replace(' ', ""))
        }
        _ => None,
    }
}
