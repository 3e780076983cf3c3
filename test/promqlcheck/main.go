// Command promqlcheck parses PromQL expressions with Prometheus's own
// parser, for the test that holds the example alerts of docs/operations.md
// to the metrics the code registers. It reads a JSON array of expressions
// on stdin and writes, for each, the parse error or what the expression
// selects: every metric selector with its label matchers, and the labels
// every aggregation groups by, with the metrics under it.
//
// It is a module of its own so that Prometheus's dependencies stay out of
// the test module, which builds kube-apiserver at a pinned version.
//
//	echo '["sum by (code) (rate(tokenbroker_http_requests_total[5m]))"]' | go run .
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"slices"

	"github.com/prometheus/prometheus/promql/parser"
)

// Result describes one expression.
type Result struct {
	Expr      string     `json:"expr"`
	Error     string     `json:"error,omitempty"`
	Selectors []Selector `json:"selectors,omitempty"`
	Groupings []Grouping `json:"groupings,omitempty"`
}

// Selector is one vector selector: the metric name and the labels it
// matches on (the name itself left out).
type Selector struct {
	Metric string    `json:"metric"`
	Labels []Matcher `json:"labels,omitempty"`
}

// Matcher is one label matcher.
type Matcher struct {
	Name  string `json:"name"`
	Op    string `json:"op"`
	Value string `json:"value"`
}

// Grouping is the label list of one aggregation (by or without) or vector
// matching (on or ignoring), with the metrics of the selectors under it.
type Grouping struct {
	Labels  []string `json:"labels"`
	Metrics []string `json:"metrics"`
}

func main() {
	var exprs []string
	if err := json.NewDecoder(os.Stdin).Decode(&exprs); err != nil {
		fmt.Fprintln(os.Stderr, "promqlcheck: read a JSON array of expressions on stdin:", err)
		os.Exit(2)
	}
	out := make([]Result, 0, len(exprs))
	for _, e := range exprs {
		out = append(out, check(e))
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(out); err != nil {
		fmt.Fprintln(os.Stderr, "promqlcheck:", err)
		os.Exit(1)
	}
}

func check(expr string) Result {
	r := Result{Expr: expr}
	ast, err := parser.NewParser(parser.Options{}).ParseExpr(expr)
	if err != nil {
		r.Error = err.Error()
		return r
	}
	parser.Inspect(ast, func(n parser.Node, _ []parser.Node) error {
		switch n := n.(type) {
		case *parser.VectorSelector:
			r.Selectors = append(r.Selectors, selector(n))
		case *parser.AggregateExpr:
			if len(n.Grouping) > 0 {
				r.Groupings = append(r.Groupings, Grouping{Labels: n.Grouping, Metrics: metricsUnder(n.Expr)})
			}
		case *parser.BinaryExpr:
			if n.VectorMatching != nil && len(n.VectorMatching.MatchingLabels) > 0 {
				r.Groupings = append(r.Groupings, Grouping{Labels: n.VectorMatching.MatchingLabels, Metrics: metricsUnder(n)})
			}
		}
		return nil
	})
	return r
}

func selector(v *parser.VectorSelector) Selector {
	s := Selector{Metric: v.Name}
	for _, m := range v.LabelMatchers {
		if m.Name == "__name__" {
			continue
		}
		s.Labels = append(s.Labels, Matcher{Name: m.Name, Op: m.Type.String(), Value: m.Value})
	}
	return s
}

func metricsUnder(n parser.Node) []string {
	var names []string
	parser.Inspect(n, func(n parser.Node, _ []parser.Node) error {
		if v, ok := n.(*parser.VectorSelector); ok && !slices.Contains(names, v.Name) {
			names = append(names, v.Name)
		}
		return nil
	})
	return names
}
