//! Operator schemas as libtorch writes them (`aten::add.Tensor(Tensor self, Tensor other, *,
//! Scalar alpha=1) -> Tensor`), parsed into what the checker needs: each argument's type,
//! whether it is keyword-only, whether it has a default, and the alias annotations that say
//! which arguments an operator writes and which outputs are views of which inputs.

use std::fmt;

/// A type of the schema language, as far as graphs use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Type {
    Tensor,
    Int,
    SymInt,
    Float,
    Bool,
    /// A number of any kind (int, float or bool).
    Scalar,
    ScalarType,
    Layout,
    Device,
    MemoryFormat,
    Str,
    Optional(Box<Type>),
    List(Box<Type>),
    /// Anything else (`Generator`, `Storage`, `Dimname`, ...): no graph value has it.
    Other(String),
}

impl Type {
    fn base(name: &str) -> Self {
        match name {
            "Tensor" => Type::Tensor,
            "int" => Type::Int,
            "SymInt" => Type::SymInt,
            "float" => Type::Float,
            "bool" => Type::Bool,
            "Scalar" => Type::Scalar,
            "ScalarType" => Type::ScalarType,
            "Layout" => Type::Layout,
            "Device" => Type::Device,
            "MemoryFormat" => Type::MemoryFormat,
            "str" => Type::Str,
            other => Type::Other(other.to_owned()),
        }
    }

    /// The type without an `Optional` around it.
    pub fn required(&self) -> &Type {
        match self {
            Type::Optional(inner) => inner,
            other => other,
        }
    }
}

impl fmt::Display for Type {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Type::Optional(t) => write!(f, "{t}?"),
            Type::List(t) => write!(f, "{t}[]"),
            Type::Other(name) => f.write_str(name),
            base => write!(f, "{base:?}"),
        }
    }
}

/// `(a)`: in alias set `a`; `(a!)`: and written; `(a -> *)`: its views end up in a list;
/// `(b|a)`: in set `b` or set `a` (`aten::to.prim_dtype`'s return may be its input).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alias {
    pub sets: Vec<String>,
    pub write: bool,
}

impl Alias {
    /// Whether the two may name the same memory: they share a set.
    pub fn overlaps(&self, other: &Alias) -> bool {
        self.sets.iter().any(|s| other.sets.contains(s))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Argument {
    pub name: String,
    pub ty: Type,
    pub alias: Option<Alias>,
    pub has_default: bool,
    pub kwarg_only: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Return {
    pub ty: Type,
    pub alias: Option<Alias>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schema {
    /// `aten::add`
    pub name: String,
    /// `Tensor`; empty for the default overload.
    pub overload: String,
    pub arguments: Vec<Argument>,
    pub returns: Vec<Return>,
}

impl Schema {
    /// `aten::add.Tensor`, or `aten::relu` for a default overload.
    pub fn qualified(&self) -> String {
        qualified(&self.name, &self.overload)
    }

    /// Whether the operator writes any of its arguments.
    pub fn writes(&self) -> bool {
        self.arguments.iter().any(|a| a.alias.as_ref().is_some_and(|al| al.write))
    }
}

pub fn qualified(name: &str, overload: &str) -> String {
    if overload.is_empty() { name.to_owned() } else { format!("{name}.{overload}") }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot parse the schema {schema:?}: {why}")]
pub struct SchemaError {
    pub schema: String,
    pub why: &'static str,
}

/// Parses one schema.
pub fn parse(text: &str) -> Result<Schema, SchemaError> {
    let fail = |why| SchemaError { schema: text.to_owned(), why };
    let text = text.trim();
    let open = text.find('(').ok_or(fail("no argument list"))?;
    let (qualified, rest) = text.split_at(open);
    let (name, overload) = match qualified.split_once('.') {
        Some((n, o)) => (n.to_owned(), o.to_owned()),
        None => (qualified.to_owned(), String::new()),
    };
    if !name.contains("::") {
        return Err(fail("the name has no namespace"));
    }
    let close = matching_paren(rest).ok_or(fail("unbalanced parentheses"))?;
    let arguments_text = &rest[1..close];
    let after = rest[close + 1..].trim();
    let returns_text = after.strip_prefix("->").ok_or(fail("no returns"))?.trim();
    let mut arguments = Vec::new();
    let mut kwarg_only = false;
    for item in split_top_level(arguments_text) {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        if item == "*" {
            kwarg_only = true;
            continue;
        }
        let (decl, default) = match item.split_once('=') {
            Some((d, v)) => (d.trim(), Some(v.trim())),
            None => (item, None),
        };
        let (ty_text, name) = decl.rsplit_once(' ').ok_or(fail("an argument without a name"))?;
        let (ty, alias) = parse_type(ty_text.trim()).ok_or(fail("an argument's type"))?;
        arguments.push(Argument { name: name.to_owned(), ty, alias, has_default: default.is_some(), kwarg_only });
    }
    let returns_inner = if returns_text.starts_with('(') {
        let end = matching_paren(returns_text).ok_or(fail("unbalanced returns"))?;
        &returns_text[1..end]
    } else {
        returns_text
    };
    let mut returns = Vec::new();
    for item in split_top_level(returns_inner) {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        // A named return: `Tensor(a!) values`.
        let ty_text = match item.rsplit_once(' ') {
            Some((t, n)) if !n.contains(['(', ')', '[', ']', '?']) => t.trim(),
            _ => item,
        };
        let (ty, alias) = parse_type(ty_text).ok_or(fail("a return's type"))?;
        returns.push(Return { ty, alias });
    }
    Ok(Schema { name, overload, arguments, returns })
}

/// The index of the parenthesis that closes the one `s` starts with.
fn matching_paren(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => {}
        }
    }
    None
}

/// Splits on commas outside parentheses and brackets.
fn split_top_level(s: &str) -> Vec<&str> {
    let (mut depth, mut start, mut out) = (0i32, 0, Vec::new());
    for (i, c) in s.char_indices() {
        match c {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

/// `Tensor(a!)[]?` and the like: a base name, an optional alias annotation, then `[]`, `[N]`
/// and `?` suffixes applied in order.
fn parse_type(text: &str) -> Option<(Type, Option<Alias>)> {
    let base_end = text.find(['(', '[', '?']).unwrap_or(text.len());
    let mut ty = Type::base(&text[..base_end]);
    if text[..base_end].is_empty() {
        return None;
    }
    let mut rest = &text[base_end..];
    let mut alias = None;
    if rest.starts_with('(') {
        let end = matching_paren(rest)?;
        let inner = rest[1..end].trim();
        let before = inner.split(['!', ' ', '-']).next().unwrap_or("");
        let sets = before.split('|').filter(|s| !s.is_empty()).map(str::to_owned).collect();
        alias = Some(Alias { sets, write: inner.contains('!') });
        rest = &rest[end + 1..];
    }
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix('?') {
            ty = Type::Optional(Box::new(ty));
            rest = r;
        } else if rest.starts_with('[') {
            let end = rest.find(']')?;
            ty = Type::List(Box::new(ty));
            rest = &rest[end + 1..];
        } else {
            return None;
        }
    }
    Some((ty, alias))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemas_parse_as_libtorch_writes_them() {
        let add = parse("aten::add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor").unwrap();
        assert_eq!((add.name.as_str(), add.overload.as_str()), ("aten::add", "Tensor"));
        assert_eq!(add.arguments.len(), 3);
        assert!(add.arguments[2].kwarg_only && add.arguments[2].has_default && !add.arguments[1].kwarg_only);
        assert_eq!(add.returns, vec![Return { ty: Type::Tensor, alias: None }]);
        assert!(!add.writes());

        let split =
            parse("aten::split.Tensor(Tensor(a -> *) self, SymInt split_size, int dim=0) -> Tensor(a)[]").unwrap();
        assert_eq!(split.arguments[0].alias, Some(Alias { sets: vec!["a".into()], write: false }));
        let to = parse("aten::to.prim_dtype(Tensor(a) self, int? dtype=None, bool non_blocking=False, bool copy=False) -> Tensor(b|a)").unwrap();
        let (ret, arg) = (to.returns[0].alias.as_ref().unwrap(), to.arguments[0].alias.as_ref().unwrap());
        assert_eq!(ret.sets, ["b", "a"]);
        assert!(ret.overlaps(arg) && !ret.write);
        assert_eq!(split.returns[0].ty, Type::List(Box::new(Type::Tensor)));

        let copy =
            parse("aten::index_copy_(Tensor(a!) self, int dim, Tensor index, Tensor source) -> Tensor(a!)").unwrap();
        assert!(copy.writes() && copy.qualified() == "aten::index_copy_");

        let ln = parse(
            "aten::layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight=None, Tensor? bias=None, \
             float eps=1.0000000000000001e-05, bool cudnn_enable=True) -> Tensor",
        )
        .unwrap();
        assert_eq!(ln.arguments[1].ty, Type::List(Box::new(Type::SymInt)));
        assert_eq!(ln.arguments[2].ty, Type::Optional(Box::new(Type::Tensor)));

        let index = parse("aten::index.Tensor(Tensor self, Tensor?[] indices) -> Tensor").unwrap();
        assert_eq!(index.arguments[1].ty, Type::List(Box::new(Type::Optional(Box::new(Type::Tensor)))));

        let many = parse("aten::native_layer_norm(Tensor input, SymInt[] normalized_shape, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)").unwrap();
        assert_eq!(many.returns.len(), 3);
        let named = parse("aten::max.dim(Tensor self, int dim, bool keepdim=False) -> (Tensor values, Tensor indices)")
            .unwrap();
        assert_eq!(named.returns.len(), 2);
        let none = parse("aten::_assert_tensor_metadata(Tensor a, SymInt[]? size=None, SymInt[]? stride=None, ScalarType? dtype=None, *, Device? device=None, Layout? layout=None) -> ()").unwrap();
        assert!(none.returns.is_empty());
        assert_eq!(none.arguments[1].ty, Type::Optional(Box::new(Type::List(Box::new(Type::SymInt)))));
        let fixed = parse("aten::max_pool2d(Tensor self, int[2] kernel_size, int[2] stride=[], int[2] padding=0, int[2] dilation=1, bool ceil_mode=False) -> Tensor").unwrap();
        assert_eq!(fixed.arguments[1].ty, Type::List(Box::new(Type::Int)));
        assert!(fixed.arguments[5].has_default);
    }

    #[test]
    fn malformed_schemas_are_errors() {
        for bad in [
            "",
            "add(Tensor self) -> Tensor",
            "aten::add(Tensor self -> Tensor",
            "aten::add(Tensor self)",
            "aten::f(self) -> Tensor",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}
