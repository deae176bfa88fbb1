//! What a node checks before it runs a graph: every value defined once and before its use,
//! every operator on the allowlist, every call's arguments of the schema's types and arity,
//! writes only to the graph's own intermediates (never an input or a weight, nor a view of
//! one), and random operators only with their randomness off. A refusal names the node, the
//! operator and why.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, OnceLock};

use crate::format::{Arg, Graph, MAX_LIST, MAX_RANK, MAX_VALUES, Node, Program, dtype};
use crate::rules::ValueRule;
use crate::schema::{self, Schema, Type};

/// The operators a node runs: graph/allowlist.txt (written by graph/allowlist.py).
pub fn allowlist() -> &'static Allowlist {
    static LIST: OnceLock<Allowlist> = OnceLock::new();
    LIST.get_or_init(|| Allowlist::parse(include_str!("../allowlist.txt")).expect("graph/allowlist.txt parses"))
}

#[derive(Debug)]
pub struct Allowlist {
    by_name: HashMap<String, Arc<Schema>>,
    /// Each schema's text as in the file (the runner compares it with the dispatcher's).
    texts: HashMap<String, String>,
    /// Per operator, the rules on its arguments' values, by argument slot (`rule` lines).
    rules: HashMap<String, Vec<(usize, ValueRule)>>,
    /// Operators whose outputs can be an input though their schemas say not (`returns-input`
    /// lines: `type_as(w, w)` is `w`).
    returns_input: HashSet<String>,
}

impl Allowlist {
    /// One schema per line, as libtorch prints it; then `rule OP ARG RULE...` (see
    /// [`ValueRule::parse`]) and `returns-input OP` lines about the operators above them.
    pub fn parse(text: &str) -> Result<Self, schema::SchemaError> {
        let mut list = Self {
            by_name: HashMap::new(),
            texts: HashMap::new(),
            rules: HashMap::new(),
            returns_input: HashSet::new(),
        };
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
            let fail = |why| schema::SchemaError { schema: line.to_owned(), why };
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["rule", op, arg, rule @ ..] => {
                    let schema = list.by_name.get(*op).ok_or(fail("a rule for an operator not listed above it"))?;
                    let slot = schema.arguments.iter().position(|a| a.name == *arg).ok_or(fail("no such argument"))?;
                    let rule = ValueRule::parse(rule).ok_or(fail("a rule is `one-of N...` or `within LOW HIGH`"))?;
                    list.rules.entry((*op).to_owned()).or_default().push((slot, rule));
                }
                ["returns-input", op] => {
                    if !list.by_name.contains_key(*op) {
                        return Err(fail("returns-input names an operator not listed above it"));
                    }
                    list.returns_input.insert((*op).to_owned());
                }
                _ => {
                    let s = schema::parse(line)?;
                    list.texts.insert(s.qualified(), line.to_owned());
                    list.by_name.insert(s.qualified(), Arc::new(s));
                }
            }
        }
        Ok(list)
    }

    pub fn get(&self, qualified: &str) -> Option<&Arc<Schema>> {
        self.by_name.get(qualified)
    }

    pub fn text(&self, qualified: &str) -> Option<&str> {
        self.texts.get(qualified).map(String::as_str)
    }

    /// The qualified names of its operators (`aten::add.Tensor`), in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.by_name.keys().map(String::as_str)
    }

    /// The rules on `qualified`'s argument values, by argument slot.
    pub fn rules(&self, qualified: &str) -> &[(usize, ValueRule)] {
        self.rules.get(qualified).map_or(&[], Vec::as_slice)
    }

    /// Whether an output of `qualified` can be one of its inputs (or a view of one), whatever
    /// its schema says.
    pub fn returns_input(&self, qualified: &str) -> bool {
        self.returns_input.contains(qualified)
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}

/// The runner's own operations, on integers and lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Native {
    Add,
    Sub,
    Mul,
    FloorDiv,
    Mod,
    Neg,
    Min,
    Max,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    /// `(list, index)`: an item of an operator's list output.
    GetItem,
    /// `(tensor, dim)`: a dimension's size.
    Size,
}

impl Native {
    fn parse(op: &str) -> Option<Self> {
        Some(match op.strip_prefix("native::")? {
            "add" => Native::Add,
            "sub" => Native::Sub,
            "mul" => Native::Mul,
            "floordiv" => Native::FloorDiv,
            "mod" => Native::Mod,
            "neg" => Native::Neg,
            "min" => Native::Min,
            "max" => Native::Max,
            "eq" => Native::Eq,
            "ne" => Native::Ne,
            "lt" => Native::Lt,
            "le" => Native::Le,
            "gt" => Native::Gt,
            "ge" => Native::Ge,
            "getitem" => Native::GetItem,
            "size" => Native::Size,
            _ => return None,
        })
    }

    fn arity(self) -> usize {
        match self {
            Native::Neg => 1,
            _ => 2,
        }
    }
}

/// What a value is, as far as the checker can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Tensor,
    Int,
    Float,
    Bool,
    /// A number from a `Scalar` return.
    Number,
    TensorList,
    IntList,
}

/// One node, checked: an operator of the allowlist with its arguments in the schema's order
/// (`None`: the schema's default), or a native operation.
#[derive(Debug, Clone)]
pub enum Step {
    /// `generator`: the slot of the operator's generator argument, which the node fills with
    /// the request's own generator.
    Op {
        schema: Arc<Schema>,
        args: Vec<Option<Arg>>,
        generator: Option<usize>,
    },
    Native {
        op: Native,
        args: Vec<Arg>,
    },
}

/// A program that passed the check, with each node's step.
#[derive(Debug, Clone)]
pub struct Checked {
    pub program: Program,
    /// One per graph of the program: its own, then its entries'.
    pub graphs: Vec<CheckedGraph>,
}

/// One graph of a checked program: a step per node.
#[derive(Debug, Clone)]
pub struct CheckedGraph {
    pub steps: Vec<Step>,
    /// One past the largest value id.
    pub values: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckError {
    #[error("node {node} ({op}): {why}")]
    Node { node: usize, op: String, why: String },
    #[error("{0}")]
    Graph(String),
}

/// Where a tensor's memory comes from: writing it is allowed only for the graph's own and a
/// session's state. Ordered from the most writable: a value that may view either of two roots
/// has the later one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Root {
    Own,
    State,
    Input,
    Weight,
}

struct State {
    kinds: Vec<Option<Kind>>,
    roots: Vec<Root>,
}

impl State {
    fn define(&mut self, id: u32, kind: Kind, root: Root) -> Result<(), String> {
        let i = id as usize;
        if i >= MAX_VALUES {
            return Err(format!("value {id} is past the limit of {MAX_VALUES} values"));
        }
        if i >= self.kinds.len() {
            self.kinds.resize(i + 1, None);
            self.roots.resize(i + 1, Root::Own);
        }
        if self.kinds[i].is_some() {
            return Err(format!("value {id} is defined twice"));
        }
        self.kinds[i] = Some(kind);
        self.roots[i] = root;
        Ok(())
    }

    fn kind(&self, id: u32) -> Result<Kind, String> {
        self.kinds.get(id as usize).copied().flatten().ok_or_else(|| format!("value {id} is used before it is defined"))
    }
}

/// Checks `program` against `allowlist`: each of its graphs.
pub fn check(program: Program, allowlist: &Allowlist) -> Result<Checked, CheckError> {
    for s in &program.state {
        if crate::format::tensor_len(&s.dtype, &s.shape).is_none() {
            return Err(CheckError::Graph(format!("state {:?} is a {} {:?} tensor", s.name, s.dtype, s.shape)));
        }
    }
    let mut graphs = Vec::with_capacity(1 + program.entries.len());
    for (i, g) in program.graphs().enumerate() {
        let checked = check_graph(&program, g, allowlist).map_err(|e| match i {
            0 => e,
            _ => CheckError::Graph(format!("entry {i}: {e}")),
        })?;
        graphs.push(checked);
    }
    Ok(Checked { program, graphs })
}

fn check_graph(program: &Program, g: Graph<'_>, allowlist: &Allowlist) -> Result<CheckedGraph, CheckError> {
    let graph = CheckError::Graph;
    let mut state = State { kinds: Vec::new(), roots: Vec::new() };
    // The session's state comes last, one input per tensor of it, as the program declares it.
    let first_state = g.inputs.len().checked_sub(program.state.len()).ok_or_else(|| {
        graph(format!("{} inputs; the program's state alone has {} tensors", g.inputs.len(), program.state.len()))
    })?;
    for (i, input) in g.inputs.iter().enumerate() {
        if dtype(&input.dtype).is_none() {
            return Err(graph(format!("input {:?} has the unknown dtype {:?}", input.name, input.dtype)));
        }
        if input.dims.len() > MAX_RANK || input.dims.iter().any(|d| d.min < 0 || d.min > d.max) {
            return Err(graph(format!("input {:?} has bad dimension ranges {:?}", input.name, input.dims)));
        }
        if input.state != (i >= first_state) {
            return Err(graph(format!(
                "input {:?}: the program's {} state tensors are the last inputs, and only they",
                input.name,
                program.state.len()
            )));
        }
        let root = if input.state {
            let spec = &program.state[i - first_state];
            let same = spec.dtype == input.dtype
                && spec.shape.len() == input.dims.len()
                && spec.shape.iter().zip(&input.dims).all(|(&n, d)| d.min == n && d.max == n);
            if !same {
                return Err(graph(format!("input {:?} is not shaped as state {:?}", input.name, spec.name)));
            }
            Root::State
        } else {
            Root::Input
        };
        state.define(input.value, Kind::Tensor, root).map_err(graph)?;
    }
    for weight in &program.weights {
        state.define(weight.value, Kind::Tensor, Root::Weight).map_err(graph)?;
    }
    let mut steps = Vec::with_capacity(g.nodes.len());
    for (i, node) in g.nodes.iter().enumerate() {
        let fail = |why: String| CheckError::Node { node: i, op: schema::qualified(&node.op, &node.overload), why };
        let step = check_node(node, allowlist, &mut state).map_err(fail)?;
        steps.push(step);
    }
    for out in g.outputs {
        match out {
            Arg::Value(_) | Arg::Int(_) | Arg::Float(_) | Arg::Bool(_) | Arg::None => {}
            other => return Err(graph(format!("an output is {other:?}: graphs return tensors and numbers"))),
        }
        arg_kind(out, &state).map_err(|e| graph(format!("an output: {e}")))?;
    }
    // The new state, last: tensors of the graph's own or of the state (never a weight or an
    // input, which a later step's writes to the state would then write).
    let new_state = g.outputs.len().checked_sub(program.state.len()).map(|at| &g.outputs[at..]);
    let new_state =
        new_state.ok_or_else(|| graph(format!("fewer outputs than the {} state tensors", program.state.len())))?;
    for (out, spec) in new_state.iter().zip(&program.state) {
        let fits = match out {
            Arg::Value(id) => {
                state.kind(*id).ok() == Some(Kind::Tensor)
                    && matches!(state.roots.get(*id as usize), Some(Root::Own | Root::State))
            }
            _ => false,
        };
        if !fits {
            return Err(graph(format!(
                "the new value of state {:?} is {out:?}: a tensor the graph computed, or the state",
                spec.name
            )));
        }
    }
    Ok(CheckedGraph { steps, values: state.kinds.len() })
}

fn check_node(node: &Node, allowlist: &Allowlist, state: &mut State) -> Result<Step, String> {
    if let Some(op) = Native::parse(&node.op) {
        return check_native(op, node, state);
    }
    let qualified = schema::qualified(&node.op, &node.overload);
    let schema = allowlist.get(&qualified).ok_or_else(|| {
        "not on the allowlist of operators a node runs (graph/allowlist.txt): operators that touch files, \
         processes, the network or global state, write their inputs, draw random numbers without a generator the \
         node can give, or return uninitialised memory are not"
            .to_owned()
    })?;
    // Bind the arguments to the schema's, positional then keyword.
    let positional = schema.arguments.iter().filter(|a| !a.kwarg_only).count();
    if node.args.len() > positional {
        return Err(format!("{} positional arguments; the schema takes {positional}", node.args.len()));
    }
    let mut bound: Vec<Option<Arg>> = vec![None; schema.arguments.len()];
    for (slot, arg) in bound.iter_mut().zip(&node.args) {
        *slot = Some(arg.clone());
    }
    for (name, arg) in &node.kwargs {
        let at = schema
            .arguments
            .iter()
            .position(|a| &a.name == name)
            .ok_or_else(|| format!("no argument named {name:?}"))?;
        if bound[at].is_some() {
            return Err(format!("argument {name:?} given twice"));
        }
        bound[at] = Some(arg.clone());
    }
    let mut generator = None;
    for (i, (arg, given)) in schema.arguments.iter().zip(&bound).enumerate() {
        if matches!(arg.ty.required(), Type::Other(name) if name == "Generator") {
            if given.as_ref().is_some_and(|g| *g != Arg::None) {
                return Err(format!(
                    "argument {:?}: a graph passes no generator (the node gives each request its own)",
                    arg.name
                ));
            }
            generator = Some(i);
            continue;
        }
        match given {
            None if !arg.has_default => return Err(format!("argument {:?} is missing", arg.name)),
            None => {}
            Some(given) => {
                conforms(given, &arg.ty, state).map_err(|e| format!("argument {:?} ({}): {e}", arg.name, arg.ty))?
            }
        }
    }
    random_off(&qualified, schema, &bound)?;
    for (slot, rule) in allowlist.rules(&qualified) {
        if let (Some(given), Some(arg)) = (&bound[*slot], schema.arguments.get(*slot)) {
            rule.check(given).map_err(|e| format!("argument {:?}: {e}", arg.name))?;
        }
    }
    // Writes: only to the graph's own memory.
    for (arg, given) in schema.arguments.iter().zip(&bound) {
        if arg.alias.as_ref().is_some_and(|a| a.write)
            && let Some(Arg::Value(id)) = given
        {
            match state.roots.get(*id as usize) {
                Some(Root::Own | Root::State) => {}
                Some(Root::Input) => {
                    return Err(format!("writes argument {:?}, which is (a view of) an input", arg.name));
                }
                _ => return Err(format!("writes argument {:?}, which is (a view of) a weight", arg.name)),
            }
        }
    }
    if node.outputs.len() != schema.returns.len() {
        return Err(format!("{} outputs; the operator returns {}", node.outputs.len(), schema.returns.len()));
    }
    let returns_input = allowlist.returns_input(&qualified);
    for (ret, &out) in schema.returns.iter().zip(&node.outputs) {
        let kind = match ret.ty.required() {
            Type::Tensor => Kind::Tensor,
            Type::Int | Type::SymInt => Kind::Int,
            Type::Float => Kind::Float,
            Type::Bool => Kind::Bool,
            Type::Scalar => Kind::Number,
            Type::List(t) if **t == Type::Tensor => Kind::TensorList,
            Type::List(t) if matches!(**t, Type::Int | Type::SymInt) => Kind::IntList,
            other => return Err(format!("returns a {other}, which graphs do not carry")),
        };
        // An output in an argument's alias set views that argument's memory; an operator that can
        // return an input unannotated may view any of its tensor arguments'.
        let may_view = |a: &schema::Argument| match (&ret.alias, &a.alias) {
            _ if returns_input => true,
            (Some(ret), Some(arg)) => ret.overlaps(arg),
            _ => false,
        };
        let root = schema
            .arguments
            .iter()
            .zip(&bound)
            .filter(|(a, _)| may_view(a))
            .filter_map(|(_, given)| given.as_ref())
            .flat_map(|given| roots_of(given, state))
            .max()
            .unwrap_or(Root::Own);
        state.define(out, kind, root)?;
    }
    Ok(Step::Op { schema: Arc::clone(schema), args: bound, generator })
}

/// The roots of the tensors an argument holds (a list's items each).
fn roots_of(arg: &Arg, state: &State) -> Vec<Root> {
    match arg {
        Arg::Value(id) => state.roots.get(*id as usize).copied().into_iter().collect(),
        Arg::List(items) => items.iter().flat_map(|a| roots_of(a, state)).collect(),
        _ => Vec::new(),
    }
}

/// The two operators on the allowlist that are random only through an argument: it must be a
/// constant that turns the randomness off.
fn random_off(qualified: &str, schema: &Schema, bound: &[Option<Arg>]) -> Result<(), String> {
    let (name, off): (&str, fn(&Arg) -> bool) = match qualified {
        "aten::scaled_dot_product_attention" => ("dropout_p", |a| match a {
            Arg::Float(f) => f.parse::<f64>().is_ok_and(|f| f == 0.0),
            Arg::Int(0) => true,
            _ => false,
        }),
        "aten::dropout" => ("train", |a| matches!(a, Arg::Bool(false))),
        _ => return Ok(()),
    };
    let at = schema.arguments.iter().position(|a| a.name == name).ok_or("the schema lost its random argument")?;
    match &bound[at] {
        None => Ok(()),
        Some(arg) if off(arg) => Ok(()),
        Some(_) => Err(format!(
            "random unless {name} is a constant that turns it off (per-request generators are not built yet)"
        )),
    }
}

fn check_native(op: Native, node: &Node, state: &mut State) -> Result<Step, String> {
    if !node.kwargs.is_empty() || node.args.len() != op.arity() || node.outputs.len() != 1 {
        return Err(format!("takes {} arguments and gives one value", op.arity()));
    }
    let int_like = |a: &Arg| matches!(arg_kind(a, state), Ok(Some(Kind::Int | Kind::Bool)));
    let kind = match op {
        Native::GetItem => {
            let Arg::Value(list) = &node.args[0] else { return Err("getitem of a constant".into()) };
            if !matches!(node.args[1], Arg::Int(_)) {
                return Err("getitem's index must be a constant".into());
            }
            let root = state.roots.get(*list as usize).copied().unwrap_or(Root::Own);
            let kind = match state.kind(*list)? {
                Kind::TensorList => Kind::Tensor,
                Kind::IntList => Kind::Int,
                other => return Err(format!("getitem of a {other:?}")),
            };
            state.define(node.outputs[0], kind, root)?;
            return Ok(Step::Native { op, args: node.args.clone() });
        }
        Native::Size => {
            if arg_kind(&node.args[0], state)? != Some(Kind::Tensor) || !int_like(&node.args[1]) {
                return Err("size takes a tensor and a dimension".into());
            }
            Kind::Int
        }
        Native::Eq | Native::Ne | Native::Lt | Native::Le | Native::Gt | Native::Ge => {
            if !node.args.iter().all(int_like) {
                return Err("compares integers".into());
            }
            Kind::Bool
        }
        _ => {
            if !node.args.iter().all(int_like) {
                return Err("computes on integers".into());
            }
            Kind::Int
        }
    };
    state.define(node.outputs[0], kind, Root::Own)?;
    Ok(Step::Native { op, args: node.args.clone() })
}

/// The kind of a value argument; `None` for a constant.
fn arg_kind(arg: &Arg, state: &State) -> Result<Option<Kind>, String> {
    match arg {
        Arg::Value(id) => state.kind(*id).map(Some),
        Arg::Int(_) => Ok(Some(Kind::Int)),
        Arg::Bool(_) => Ok(Some(Kind::Bool)),
        Arg::List(items) => {
            for item in items {
                arg_kind(item, state)?;
            }
            Ok(None)
        }
        _ => Ok(None),
    }
}

/// Whether `arg` can be passed where the schema has `ty`.
fn conforms(arg: &Arg, ty: &Type, state: &State) -> Result<(), String> {
    let value = |id: &u32| state.kind(*id);
    let ok = match (ty, arg) {
        (Type::Optional(_), Arg::None) => true,
        (Type::Optional(inner), other) => return conforms(other, inner, state),
        (Type::Tensor, Arg::Value(id)) => {
            matches!(value(id)?, Kind::Tensor | Kind::Int | Kind::Float | Kind::Bool | Kind::Number)
        }
        // A number where a tensor goes: Python passes it as a wrapped number (a scalar tensor).
        (Type::Tensor, Arg::Int(_) | Arg::Bool(_)) => true,
        (Type::Tensor, Arg::Float(f)) => f.parse::<f64>().is_ok(),
        (Type::Int | Type::SymInt, Arg::Int(_)) => true,
        (Type::Int | Type::SymInt, Arg::Value(id)) => matches!(value(id)?, Kind::Int),
        (Type::Float, Arg::Float(f)) => f.parse::<f64>().is_ok(),
        (Type::Float, Arg::Int(_)) => true,
        (Type::Float, Arg::Value(id)) => matches!(value(id)?, Kind::Int | Kind::Float | Kind::Number),
        (Type::Bool, Arg::Bool(_)) => true,
        (Type::Bool, Arg::Value(id)) => value(id)? == Kind::Bool,
        (Type::Scalar, Arg::Int(_) | Arg::Bool(_)) => true,
        (Type::Scalar, Arg::Float(f)) => f.parse::<f64>().is_ok(),
        (Type::Scalar, Arg::Value(id)) => matches!(value(id)?, Kind::Int | Kind::Float | Kind::Bool | Kind::Number),
        (Type::ScalarType, Arg::Dtype(name)) => dtype(name).is_some(),
        (Type::Layout, Arg::Layout(l)) => l == "strided",
        (Type::Device, Arg::Device(d)) => d == "node",
        (Type::MemoryFormat, Arg::MemoryFormat(m)) => {
            matches!(m.as_str(), "contiguous" | "preserve" | "channels_last" | "channels_last_3d")
        }
        (Type::Str, Arg::Str(_)) => true,
        (Type::List(inner), Arg::List(items)) => {
            if items.len() > MAX_LIST {
                return Err(format!("a list of {} items, over {MAX_LIST}", items.len()));
            }
            for item in items {
                conforms(item, inner, state)?;
            }
            true
        }
        (Type::List(inner), Arg::Value(id)) => match value(id)? {
            Kind::TensorList => **inner == Type::Tensor,
            Kind::IntList => matches!(**inner, Type::Int | Type::SymInt),
            _ => false,
        },
        _ => false,
    };
    if ok { Ok(()) } else { Err(format!("{arg:?} is not a {ty}")) }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::format::{DimRange, FORMAT, Input, Weight};

    fn node(op: &str, overload: &str, args: Vec<Arg>, outputs: Vec<u32>) -> Node {
        Node { op: op.into(), overload: overload.into(), args, kwargs: BTreeMap::new(), outputs }
    }

    /// x (value 0) and a weight w (value 1), then `nodes`, returning value `out`.
    fn program(nodes: Vec<Node>, out: u32) -> Program {
        Program {
            format: FORMAT,
            inputs: vec![Input {
                name: "x".into(),
                value: 0,
                dtype: "float32".into(),
                dims: vec![DimRange { min: 1, max: 8 }, DimRange { min: 4, max: 4 }],
                state: false,
            }],
            weights: vec![Weight { name: "w".into(), value: 1, dtype: "float32".into(), shape: vec![4, 4], offset: 0 }],
            nodes,
            outputs: vec![Arg::Value(out)],
            state: vec![],
            entries: vec![],
        }
    }

    fn refusal(p: Program) -> String {
        check(p, allowlist()).unwrap_err().to_string()
    }

    #[test]
    fn the_allowlist_is_what_the_generator_wrote() {
        let list = allowlist();
        assert!(list.len() > 250, "{} operators", list.len());
        assert_eq!(list.names().count(), list.len());
        assert!(list.names().all(|name| list.get(name).is_some() && list.text(name).is_some()));
        for op in
            ["aten::linear", "aten::scaled_dot_product_attention", "aten::layer_norm", "aten::embedding", "aten::view"]
        {
            assert!(list.get(op).is_some(), "{op}");
        }
        for op in [
            "aten::from_file",
            "aten::save",
            "aten::empty.memory_format",
            "aten::rand_like",
            "aten::native_dropout",
            "aten::add.out",
            "aten::add_.Tensor",
            "aten::_local_scalar_dense",
        ] {
            assert!(list.get(op).is_none(), "{op} must not be on it");
        }
    }

    #[test]
    fn a_well_formed_graph_passes() {
        let p = program(
            vec![
                node("aten::linear", "", vec![Arg::Value(0), Arg::Value(1), Arg::None], vec![2]),
                node("native::size", "", vec![Arg::Value(2), Arg::Int(0)], vec![3]),
                node("native::mul", "", vec![Arg::Value(3), Arg::Int(4)], vec![4]),
                node("aten::view", "", vec![Arg::Value(2), Arg::List(vec![Arg::Value(4)])], vec![5]),
                node("aten::split", "Tensor", vec![Arg::Value(5), Arg::Int(2)], vec![6]),
                node("native::getitem", "", vec![Arg::Value(6), Arg::Int(1)], vec![7]),
            ],
            7,
        );
        let checked = check(p, allowlist()).unwrap();
        assert_eq!(checked.graphs.len(), 1);
        assert_eq!(checked.graphs[0].steps.len(), 6);
        assert_eq!(checked.graphs[0].values, 8);
        let Step::Op { args, .. } = &checked.graphs[0].steps[0] else { panic!() };
        assert_eq!(args.len(), 3);
    }

    #[test]
    fn operators_off_the_allowlist_are_refused_by_name() {
        let p = program(
            vec![node(
                "aten::from_file",
                "",
                vec![Arg::Str("/etc/passwd".into()), Arg::Bool(false), Arg::Int(100)],
                vec![2],
            )],
            2,
        );
        let e = refusal(p);
        assert!(e.contains("aten::from_file") && e.contains("not on the allowlist"), "{e}");
        assert!(
            refusal(program(vec![node("c10d::allreduce_", "", vec![], vec![2])], 2)).contains("not on the allowlist")
        );
    }

    #[test]
    fn writes_to_inputs_weights_and_their_views_are_refused() {
        let write_weight = program(vec![node("aten::copy_", "", vec![Arg::Value(1), Arg::Value(0)], vec![2])], 2);
        assert!(refusal(write_weight).contains("a weight"));
        let write_input = program(vec![node("aten::fill_", "Scalar", vec![Arg::Value(0), Arg::Int(0)], vec![2])], 2);
        assert!(refusal(write_input).contains("an input"));
        // A view of the weight, then written.
        let through_view = program(
            vec![
                node("aten::t", "", vec![Arg::Value(1)], vec![2]),
                node("aten::zero_", "", vec![Arg::Value(2)], vec![3]),
            ],
            3,
        );
        assert!(refusal(through_view).contains("a weight"));
        // Its own memory may be written.
        let own = program(
            vec![
                node("aten::mul", "Tensor", vec![Arg::Value(0), Arg::Value(0)], vec![2]),
                node("aten::zero_", "", vec![Arg::Value(2)], vec![3]),
            ],
            3,
        );
        check(own, allowlist()).unwrap();
    }

    /// Operators that can give back their input with no alias annotation (found by allowlist.py
    /// running them), and `to.prim_dtype`'s `Tensor(b|a)`: their outputs are views of what they
    /// were given, so writing one writes the weight or the input.
    #[test]
    fn outputs_that_can_be_an_input_are_taken_for_views_of_it() {
        let list = allowlist();
        for op in ["aten::_unsafe_view", "aten::type_as", "aten::dropout"] {
            assert!(list.returns_input(op), "{op}");
        }
        assert!(!list.returns_input("aten::relu") && !list.returns_input("aten::clone"));
        let mask = node("aten::gt", "Scalar", vec![Arg::Value(1), Arg::Int(-100)], vec![3]);
        let fill = |target: u32| {
            node("aten::masked_fill_", "Scalar", vec![Arg::Value(target), Arg::Value(3), Arg::Int(-5)], vec![4])
        };
        let returning = |source: u32| {
            [
                node("aten::_unsafe_view", "", vec![Arg::Value(source), Arg::List(vec![Arg::Int(16)])], vec![2]),
                node("aten::type_as", "", vec![Arg::Value(source), Arg::Value(source)], vec![2]),
                node(
                    "aten::dropout",
                    "",
                    vec![Arg::Value(source), Arg::Float("0.0".into()), Arg::Bool(false)],
                    vec![2],
                ),
                node("aten::to", "prim_dtype", vec![Arg::Value(source), Arg::None], vec![2]),
            ]
        };
        for (source, why) in [(1, "a weight"), (0, "an input")] {
            for view in returning(source) {
                let name = view.op.clone();
                let e = refusal(program(vec![view, mask.clone(), fill(2)], 4));
                assert!(e.contains("masked_fill_") && e.contains(why), "{name}: {e}");
            }
        }
        // The same write to a copy is the graph's own.
        let copy = node("aten::clone", "", vec![Arg::Value(1)], vec![2]);
        check(program(vec![copy, mask, fill(2)], 4), list).unwrap();
    }

    #[test]
    fn argument_values_are_held_to_the_allowlists_rules() {
        let x4 = node(
            "aten::view",
            "",
            vec![Arg::Value(0), Arg::List(vec![Arg::Int(1), Arg::Int(1), Arg::Int(-1), Arg::Int(4)])],
            vec![2],
        );
        let grid =
            node("aten::zeros", "", vec![Arg::List(vec![Arg::Int(1), Arg::Int(2), Arg::Int(2), Arg::Int(2)])], vec![3]);
        let sampler = |mode: Arg, padding: Arg| {
            node(
                "aten::grid_sampler_2d",
                "",
                vec![Arg::Value(2), Arg::Value(3), mode, padding, Arg::Bool(false)],
                vec![4],
            )
        };
        let with = |last: Node| program(vec![x4.clone(), grid.clone(), last], 4);
        check(with(sampler(Arg::Int(2), Arg::Int(1))), allowlist()).unwrap();
        for (mode, padding, why) in [(5, 0, "interpolation_mode"), (0, 3, "padding_mode"), (0, -1, "padding_mode")] {
            let e = refusal(with(sampler(Arg::Int(mode), Arg::Int(padding))));
            assert!(e.contains(why) && e.contains("one of 0, 1, 2"), "{e}");
        }
        // A mode the run computes passes the check; the runner holds it to the rule.
        let computed = node("native::add", "", vec![Arg::Int(2), Arg::Int(3)], vec![5]);
        let p = program(vec![x4.clone(), grid.clone(), computed, sampler(Arg::Value(5), Arg::Int(0))], 4);
        check(p, allowlist()).unwrap();
        let upsample = |scale: &str| {
            node(
                "aten::upsample_nearest2d",
                "",
                vec![Arg::Value(2), Arg::List(vec![Arg::Int(4), Arg::Int(4)]), Arg::Float(scale.into()), Arg::None],
                vec![4],
            )
        };
        check(program(vec![x4.clone(), upsample("2.0")], 4), allowlist()).unwrap();
        for scale in ["1e-20", "inf", "NaN", "1e300"] {
            let e = refusal(program(vec![x4.clone(), upsample(scale)], 4));
            assert!(e.contains("scales_h") && e.contains("finite"), "{scale}: {e}");
        }
        let no_stats = |training: bool| {
            node(
                "aten::_native_batch_norm_legit",
                "no_stats",
                vec![
                    Arg::Value(2),
                    Arg::None,
                    Arg::None,
                    Arg::Bool(training),
                    Arg::Float("0.1".into()),
                    Arg::Float("1e-5".into()),
                ],
                vec![4, 5, 6],
            )
        };
        check(program(vec![x4.clone(), no_stats(true)], 4), allowlist()).unwrap();
        assert!(refusal(program(vec![x4.clone(), no_stats(false)], 4)).contains("training"));
        // batch_norm training updates running_mean and running_var in place, unannotated: the
        // weight passed as them was written (graph_exec's finding). Only eval mode passes.
        let batch_norm = |training: bool| {
            node(
                "aten::batch_norm",
                "",
                vec![
                    Arg::Value(2),
                    Arg::None,
                    Arg::None,
                    Arg::Value(1),
                    Arg::Value(1),
                    Arg::Bool(training),
                    Arg::Float("0.1".into()),
                    Arg::Float("1e-5".into()),
                    Arg::Bool(false),
                ],
                vec![4],
            )
        };
        check(program(vec![x4.clone(), batch_norm(false)], 4), allowlist()).unwrap();
        // col2im's sizes within 32 bits: its check read a padding of 2^32 as 0, and its kernel
        // then ran for ever (graph_exec's finding).
        let ints = |xs: &[i64]| Arg::List(xs.iter().map(|&x| Arg::Int(x)).collect());
        let col2im = |padding: i64| {
            node(
                "aten::col2im",
                "",
                vec![
                    Arg::Value(0),
                    ints(&[2, 3]),
                    ints(&[1, 1]),
                    ints(&[1, 1]),
                    ints(&[padding, padding]),
                    ints(&[1, 1]),
                ],
                vec![4],
            )
        };
        check(program(vec![col2im(1)], 4), allowlist()).unwrap();
        let e = refusal(program(vec![col2im(1 << 32)], 4));
        assert!(e.contains("padding") && e.contains("2147483647"), "{e}");
        let e = refusal(program(vec![x4, batch_norm(true)], 4));
        assert!(e.contains("training") && e.contains("one of 0"), "{e}");
    }

    #[test]
    fn wiring_arity_types_and_randomness_are_checked() {
        let cases = [
            (vec![node("aten::relu", "", vec![Arg::Value(9)], vec![2])], "used before"),
            (vec![node("aten::relu", "", vec![Arg::Value(0)], vec![0])], "defined twice"),
            (vec![node("aten::relu", "", vec![], vec![2])], "missing"),
            (vec![node("aten::relu", "", vec![Arg::Value(0), Arg::Value(0)], vec![2])], "positional"),
            (vec![node("aten::relu", "", vec![Arg::Str("x".into())], vec![2])], "is not a Tensor"),
            (vec![node("aten::relu", "", vec![Arg::Value(0)], vec![2, 3])], "outputs"),
            (
                vec![node("aten::view", "", vec![Arg::Value(0), Arg::List(vec![Arg::Float("1.5".into())])], vec![2])],
                "is not a SymInt",
            ),
            (
                vec![node(
                    "aten::dropout",
                    "",
                    vec![Arg::Value(0), Arg::Float("0.1".into()), Arg::Bool(true)],
                    vec![2],
                )],
                "random",
            ),
            (vec![node("native::getitem", "", vec![Arg::Value(0), Arg::Int(0)], vec![2])], "getitem of a Tensor"),
            (vec![node("native::frobnicate", "", vec![], vec![2])], "not on the allowlist"),
        ];
        for (nodes, why) in cases {
            let e = refusal(program(nodes, 2));
            assert!(e.contains(why), "{e} (expected {why:?})");
        }
        let mut with_kwarg =
            node("aten::sum", "dim_IntList", vec![Arg::Value(0), Arg::List(vec![Arg::Int(0)])], vec![2]);
        with_kwarg.kwargs.insert("nope".into(), Arg::Int(1));
        assert!(refusal(program(vec![with_kwarg], 2)).contains("no argument named"));
    }

    /// `program` with a state of one f32 [1, 4] tensor: a last input (value 9) and a last
    /// output.
    fn with_state(mut p: Program, new_state: Arg) -> Program {
        p.state = vec![crate::format::State {
            name: "cache".into(),
            dtype: "float32".into(),
            shape: vec![1, 4],
            offset: None,
        }];
        p.inputs.push(Input {
            name: "cache".into(),
            value: 9,
            dtype: "float32".into(),
            dims: vec![DimRange { min: 1, max: 1 }, DimRange { min: 4, max: 4 }],
            state: true,
        });
        p.outputs.push(new_state);
        p
    }

    #[test]
    fn a_session_state_may_be_written_in_place_and_only_it() {
        let index_copy = |target: u32, out: u32| {
            node(
                "aten::index_copy_",
                "",
                vec![Arg::Value(target), Arg::Int(0), Arg::Value(3), Arg::Value(0)],
                vec![out],
            )
        };
        let zeros = node("aten::zeros", "", vec![Arg::List(vec![Arg::Int(1)])], vec![2]);
        let index = node("aten::_to_copy", "", vec![Arg::Value(2)], vec![3]);
        // The state written in place, and given back as the new state.
        let ok = with_state(program(vec![zeros.clone(), index.clone(), index_copy(9, 4)], 4), Arg::Value(4));
        check(ok, allowlist()).unwrap();
        // The same write to the caller's input or a weight is refused.
        let on_input = with_state(program(vec![zeros.clone(), index.clone(), index_copy(0, 4)], 4), Arg::Value(9));
        assert!(refusal(on_input).contains("an input"));
        let on_weight = with_state(program(vec![zeros.clone(), index.clone(), index_copy(1, 4)], 4), Arg::Value(9));
        assert!(refusal(on_weight).contains("a weight"));
        // A weight, or a view of the caller's input, never becomes the state (a later step would
        // write it).
        let e = refusal(with_state(program(vec![], 0), Arg::Value(1)));
        assert!(e.contains("new value of state"), "{e}");
        let view = node("aten::t", "", vec![Arg::Value(0)], vec![5]);
        let e = refusal(with_state(program(vec![view], 5), Arg::Value(5)));
        assert!(e.contains("new value of state"), "{e}");
        // State inputs are the last ones, shaped as the program declares.
        let mut misplaced = with_state(program(vec![], 0), Arg::Value(9));
        misplaced.inputs.swap(0, 1);
        assert!(refusal(misplaced).contains("last inputs"));
        let mut reshaped = with_state(program(vec![], 0), Arg::Value(9));
        reshaped.inputs[1].dims[1].max = 8;
        assert!(refusal(reshaped).contains("not shaped as state"));
        let mut missing = with_state(program(vec![], 0), Arg::Value(9));
        missing.outputs.clear();
        assert!(refusal(missing).contains("fewer outputs"));
    }

    #[test]
    fn every_entry_is_checked_over_the_same_weights() {
        let mut p = program(vec![node("aten::relu", "", vec![Arg::Value(0)], vec![2])], 2);
        let entry = |nodes: Vec<Node>, out: u32| crate::format::Entry {
            inputs: p.inputs.clone(),
            nodes,
            outputs: vec![Arg::Value(out)],
        };
        // A second graph reading the weight (value 1) with ids of its own.
        let reads_weight = entry(vec![node("aten::linear", "", vec![Arg::Value(0), Arg::Value(1)], vec![7])], 7);
        let bad = entry(vec![node("aten::from_file", "", vec![Arg::Str("/etc/passwd".into())], vec![7])], 7);
        p.entries = vec![reads_weight];
        let checked = check(p.clone(), allowlist()).unwrap();
        assert_eq!(checked.graphs.len(), 2);
        assert_eq!(checked.graphs[1].values, 8);
        p.entries.push(bad);
        let e = refusal(p);
        assert!(e.starts_with("entry 2: node 0 (aten::from_file)"), "{e}");
    }
}
