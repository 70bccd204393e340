//! `cargo xtask public-api [--check]`: a list of every public item of each published library
//! crate, committed under `docs/api/`, so that a change to the API shows as a diff of that list
//! and never happens by accident. The list is read from the source with `syn` (the stable
//! toolchain has no rustdoc JSON): the items of the modules a user can name, the `pub use`
//! re-exports as written, the public fields and variants, and the `pub` methods and trait
//! impls of the crate's types wherever their `impl` blocks live.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use quote::ToTokens;
use syn::{Attribute, ImplItem, Item, Visibility};

/// The library crates whose API is kept, by folder under `crates/`.
pub const CRATES: &[&str] = &[
    "dist-core",
    "dist-tcp",
    "dist-nccl-sys",
    "dist-nccl",
    "dist-hybrid",
    "dist-run",
    "dist-store",
];

#[derive(clap::Args)]
pub struct Args {
    /// Compare with the committed lists instead of writing them; fail on a difference.
    #[arg(long)]
    pub check: bool,
}

pub fn run(args: &Args) -> Result<()> {
    let mut stale = Vec::new();
    for krate in CRATES {
        let listed = list(krate)?;
        let path = snapshot_path(krate);
        if args.check {
            let committed = std::fs::read_to_string(&path).unwrap_or_default();
            if committed != listed {
                stale.push(format!(
                    "{} ({})",
                    path.display(),
                    diff(&committed, &listed)
                ));
            }
        } else {
            std::fs::create_dir_all(path.parent().expect("docs/api"))?;
            std::fs::write(&path, listed).with_context(|| format!("write {}", path.display()))?;
            println!("wrote {}", path.display());
        }
    }
    if !stale.is_empty() {
        bail!(
            "the public API changed: {}; if that is meant, run `cargo xtask public-api` and \
             commit docs/api/",
            stale.join("; ")
        );
    }
    Ok(())
}

fn snapshot_path(krate: &str) -> PathBuf {
    crate::root().join("docs/api").join(format!("{krate}.txt"))
}

/// The lines one side has and the other lacks, a few of each.
fn diff(old: &str, new: &str) -> String {
    let (a, b): (BTreeSet<&str>, BTreeSet<&str>) = (old.lines().collect(), new.lines().collect());
    let gone: Vec<&&str> = a.difference(&b).take(5).collect();
    let added: Vec<&&str> = b.difference(&a).take(5).collect();
    format!("removed {gone:?}, added {added:?}")
}

/// Every public item of one crate, one per line, sorted.
pub fn list(krate: &str) -> Result<String> {
    let root = crate::root().join("crates").join(krate).join("src/lib.rs");
    let ident = krate.replace('-', "_");
    let mut walk = Walk::default();
    walk.file(&root, &ident, true)?;
    // Inherent methods and trait impls count where their type is one a user can name.
    let named: BTreeSet<String> = walk.types.iter().cloned().collect();
    let mut lines: BTreeSet<String> = walk.lines;
    for (ty, line) in walk.impls {
        if named.contains(&ty) {
            lines.insert(line);
        }
    }
    let mut out = format!(
        "# The public API of {krate}, as `cargo xtask public-api` lists it; a change here is a \
         change to the API.\n"
    );
    for l in lines {
        out.push_str(&l);
        out.push('\n');
    }
    Ok(out)
}

#[derive(Default)]
struct Walk {
    lines: BTreeSet<String>,
    /// Names of the types defined public in a public module, or re-exported by name.
    types: BTreeSet<String>,
    /// (name, line): the public items of private modules, every `pub fn` of an inherent impl
    /// and every trait impl, each listed if its name is one a user can name.
    impls: Vec<(String, String)>,
}

fn is_pub(v: &Visibility) -> bool {
    matches!(v, Visibility::Public(_))
}

fn is_test_only(attrs: &[Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.meta.to_token_stream().to_string().contains("test")
            && !a.meta.to_token_stream().to_string().contains("not (test")
    })
}

/// ` [cfg(...)]` and ` [hidden]` marks, so that a change of either shows.
fn marks(attrs: &[Attribute]) -> String {
    let mut m = String::new();
    for a in attrs {
        let text = a.meta.to_token_stream().to_string();
        if a.path().is_ident("cfg") {
            m.push_str(&format!(" [{text}]"));
        } else if a.path().is_ident("doc") && text.contains("hidden") {
            m.push_str(" [hidden]");
        } else if a.path().is_ident("deprecated") {
            m.push_str(" [deprecated]");
        }
    }
    m
}

fn tokens(t: &impl ToTokens) -> String {
    t.to_token_stream().to_string()
}

/// A variant's fields as `{ a: T, b: U }` or `(T, U)`, without their doc comments.
fn fields(f: &syn::Fields) -> String {
    match f {
        syn::Fields::Named(n) => {
            let each: Vec<String> = n
                .named
                .iter()
                .map(|f| {
                    format!(
                        "{}: {}",
                        f.ident.as_ref().map_or(String::new(), ToString::to_string),
                        tokens(&f.ty)
                    )
                })
                .collect();
            format!(" {{ {} }}", each.join(", "))
        }
        syn::Fields::Unnamed(u) => {
            let each: Vec<String> = u.unnamed.iter().map(|f| tokens(&f.ty)).collect();
            format!("({})", each.join(", "))
        }
        syn::Fields::Unit => String::new(),
    }
}

/// `fn PATH::name(args) -> ret`, with the signature's qualifiers (`unsafe`, `const`) first.
fn fn_line(path: &str, sig: &syn::Signature) -> String {
    let text = tokens(sig);
    match text.split_once("fn ") {
        Some((qualifiers, rest)) => format!("{qualifiers}fn {path}::{rest}"),
        None => format!("fn {path}::{text}"),
    }
}

fn last_name(ty: &syn::Type) -> Option<String> {
    match ty {
        syn::Type::Path(p) => p.path.segments.last().map(|s| s.ident.to_string()),
        syn::Type::Reference(r) => last_name(&r.elem),
        _ => None,
    }
}

impl Walk {
    /// Reads one module's file; `public` is whether a user can name this module's path.
    fn file(&mut self, path: &Path, module: &str, public: bool) -> Result<()> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        let parsed = syn::parse_file(&text).with_context(|| format!("parse {}", path.display()))?;
        // A module file keeps its submodules in the folder of its name; lib.rs and mod.rs in their own.
        let dir = match path.file_name().and_then(|n| n.to_str()) {
            Some("lib.rs" | "mod.rs") => path.parent().expect("a folder").to_path_buf(),
            _ => path.with_extension(""),
        };
        self.items(&parsed.items, &dir, module, public)
    }

    fn items(&mut self, items: &[Item], dir: &Path, module: &str, public: bool) -> Result<()> {
        for item in items {
            self.item(item, dir, module, public)?;
        }
        Ok(())
    }

    fn add(&mut self, public: bool, vis: &Visibility, attrs: &[Attribute], line: String) {
        if public && is_pub(vis) {
            self.lines.insert(format!("{line}{}", marks(attrs)));
        }
    }

    /// An item named `name`, and the lines of its parts: listed where its module is public,
    /// else only if a public `use` re-exports the name.
    fn keyed(
        &mut self,
        name: String,
        public: bool,
        vis: &Visibility,
        attrs: &[Attribute],
        lines: Vec<String>,
    ) {
        if !is_pub(vis) {
            return;
        }
        let m = marks(attrs);
        if public {
            self.types.insert(name.clone());
        }
        for (i, l) in lines.into_iter().enumerate() {
            // The item's own line carries its marks; its parts carry their own.
            let l = if i == 0 { format!("{l}{m}") } else { l };
            self.impls.push((name.clone(), l));
        }
    }

    fn item(&mut self, item: &Item, dir: &Path, module: &str, public: bool) -> Result<()> {
        match item {
            Item::Mod(m) => {
                if is_test_only(&m.attrs) {
                    return Ok(());
                }
                let name = m.ident.to_string();
                let inner = format!("{module}::{name}");
                let open = public && is_pub(&m.vis);
                self.add(public, &m.vis, &m.attrs, format!("mod {inner}"));
                match &m.content {
                    Some((_, items)) => self.items(items, &dir.join(&name), &inner, open)?,
                    None => {
                        let explicit = m.attrs.iter().find_map(|a| {
                            let nv = a.meta.require_name_value().ok()?;
                            if !a.path().is_ident("path") {
                                return None;
                            }
                            match &nv.value {
                                syn::Expr::Lit(syn::ExprLit {
                                    lit: syn::Lit::Str(s),
                                    ..
                                }) => Some(dir.parent().unwrap_or(dir).join(s.value())),
                                _ => None,
                            }
                        });
                        let file = explicit
                            .or_else(|| {
                                [
                                    dir.join(format!("{name}.rs")),
                                    dir.join(&name).join("mod.rs"),
                                ]
                                .into_iter()
                                .find(|p| p.exists())
                            })
                            .with_context(|| format!("the file of module {inner}"))?;
                        self.file(&file, &inner, open)?;
                    }
                }
            }
            Item::Use(u) if is_pub(&u.vis) && !is_test_only(&u.attrs) => {
                let tree = tokens(&u.tree).replace(' ', "");
                if public {
                    for name in use_names(&u.tree) {
                        self.types.insert(name);
                    }
                }
                let line = format!("use {module}::{{{tree}}}");
                self.add(public, &u.vis, &u.attrs, line);
            }
            Item::Fn(f) => {
                let line = fn_line(module, &f.sig);
                self.keyed(
                    f.sig.ident.to_string(),
                    public,
                    &f.vis,
                    &f.attrs,
                    vec![line],
                );
            }
            Item::Struct(s) => {
                let name = format!("{module}::{}", s.ident);
                let mut lines = vec![format!("struct {name}{}", tokens(&s.generics))];
                for (i, f) in s.fields.iter().enumerate() {
                    if is_pub(&f.vis) {
                        let field = f.ident.as_ref().map_or(i.to_string(), ToString::to_string);
                        lines.push(format!("field {name}.{field}: {}", tokens(&f.ty)));
                    }
                }
                self.keyed(s.ident.to_string(), public, &s.vis, &s.attrs, lines);
            }
            Item::Enum(e) => {
                let name = format!("{module}::{}", e.ident);
                let mut lines = vec![format!("enum {name}{}", tokens(&e.generics))];
                for v in &e.variants {
                    lines.push(format!("variant {name}::{}{}", v.ident, fields(&v.fields)));
                }
                self.keyed(e.ident.to_string(), public, &e.vis, &e.attrs, lines);
            }
            Item::Trait(t) => {
                let name = format!("{module}::{}", t.ident);
                let unsafety = if t.unsafety.is_some() { "unsafe " } else { "" };
                let mut lines = vec![format!(
                    "{unsafety}trait {name}{}: {}",
                    tokens(&t.generics),
                    tokens(&t.supertraits)
                )];
                for ti in &t.items {
                    lines.push(match ti {
                        syn::TraitItem::Fn(f) => format!("trait {}", fn_line(&name, &f.sig)),
                        syn::TraitItem::Type(ty) => format!("trait type {name}::{}", ty.ident),
                        syn::TraitItem::Const(c) => {
                            format!("trait const {name}::{}: {}", c.ident, tokens(&c.ty))
                        }
                        _ => continue,
                    });
                }
                self.keyed(t.ident.to_string(), public, &t.vis, &t.attrs, lines);
            }
            Item::Type(t) => {
                let line = format!("type {module}::{} = {}", t.ident, tokens(&t.ty));
                self.keyed(t.ident.to_string(), public, &t.vis, &t.attrs, vec![line]);
            }
            Item::Const(c) => {
                let line = format!("const {module}::{}: {}", c.ident, tokens(&c.ty));
                self.keyed(c.ident.to_string(), public, &c.vis, &c.attrs, vec![line]);
            }
            Item::Static(s) => {
                let line = format!("static {module}::{}: {}", s.ident, tokens(&s.ty));
                self.keyed(s.ident.to_string(), public, &s.vis, &s.attrs, vec![line]);
            }
            Item::Macro(m) => {
                let exported = m.attrs.iter().any(|a| a.path().is_ident("macro_export"));
                if let (true, Some(id)) = (exported, &m.ident) {
                    self.lines.insert(format!("macro {id}!"));
                }
            }
            Item::Impl(i) => {
                if is_test_only(&i.attrs) {
                    return Ok(());
                }
                let Some(ty) = last_name(&i.self_ty) else {
                    return Ok(());
                };
                let generics = tokens(&i.generics);
                let self_ty = tokens(&i.self_ty);
                match &i.trait_ {
                    Some((neg, path, _)) => {
                        let neg = if neg.is_some() { "!" } else { "" };
                        let unsafety = if i.unsafety.is_some() { "unsafe " } else { "" };
                        let line = format!(
                            "{unsafety}impl{generics} {neg}{} for {self_ty}",
                            tokens(path)
                        );
                        self.impls.push((ty, line));
                    }
                    None => {
                        for ii in &i.items {
                            if let ImplItem::Fn(f) = ii
                                && is_pub(&f.vis)
                                && !is_test_only(&f.attrs)
                            {
                                let line =
                                    format!("{}{}", fn_line(&self_ty, &f.sig), marks(&f.attrs));
                                self.impls.push((ty.clone(), line));
                            }
                            if let ImplItem::Const(c) = ii
                                && is_pub(&c.vis)
                            {
                                let line =
                                    format!("const {self_ty}::{}: {}", c.ident, tokens(&c.ty));
                                self.impls.push((ty.clone(), line));
                            }
                        }
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// The names a `use` tree brings in (the renamed name where there is one).
fn use_names(tree: &syn::UseTree) -> Vec<String> {
    match tree {
        syn::UseTree::Path(p) => use_names(&p.tree),
        syn::UseTree::Name(n) => vec![n.ident.to_string()],
        syn::UseTree::Rename(r) => vec![r.rename.to_string(), r.ident.to_string()],
        syn::UseTree::Glob(_) => vec![],
        syn::UseTree::Group(g) => g.items.iter().flat_map(use_names).collect(),
    }
}

#[cfg(test)]
mod tests {
    /// The committed lists are the API as the source has it: a change to the API comes with its
    /// line in `docs/api/`, or this fails and names the lines.
    #[test]
    fn public_api_lists_are_current() {
        super::run(&super::Args { check: true }).unwrap_or_else(|e| panic!("{e:#}"));
    }

    /// The list sees what it should: a public re-export, a method of a public type, a trait's
    /// method, and nothing of a private module or of the tests.
    #[test]
    fn the_list_sees_the_api() {
        let core = super::list("dist-core").expect("list dist-core");
        for want in [
            "trait dist_core::backend::Backend",
            "enum dist_core::error::DistError",
            "fn Group < L >::form",
            "trait fn dist_core::backend::Backend::rank (& self)",
            "use dist_core::{",
        ] {
            assert!(
                core.contains(want),
                "no `{want}` in dist-core's list:\n{core}"
            );
        }
        assert!(
            !core.contains("mod tests"),
            "a test module in the list:\n{core}"
        );
    }
}
