// Package check is the command-line contract of the consumer checkers:
// each checker is a small program, in a module of its own pinned to one
// consumer's release, that loads a Secret the tokenbroker agent wrote with
// that consumer's production code and then lists ConfigMaps in the target
// cluster with the client it got. test/conformance runs them and reads
// their one JSON line.
//
// Exit status: 0 when the consumer's code built a client (whether or not
// the target cluster then accepted its credential: see Result.Status), 1
// when it refused the Secret, 2 for a usage error. A checker given
// WithWatch also has a watch mode (--watch, watch.go), which starts the
// consumer's informer or cache instead of one list and prints a line per
// event until the consumer loses the cluster.
package check

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
)

// Args name the Secret to load and what to list with the client.
type Args struct {
	// Kubeconfig is the source cluster's, where the Secret lives.
	Kubeconfig string
	// Namespace, Name and Key name the Secret and, where the consumer
	// lets its user choose one, the data key ("" for the default).
	Namespace, Name, Key string
	// ListNamespace is where to list ConfigMaps in the target cluster.
	ListNamespace string
	// ServiceAccount, where the consumer supports it, is a ServiceAccount
	// of the target cluster to impersonate (Flux's spec.serviceAccountName).
	ServiceAccount string
	// Watch selects watch mode, for a checker that has one.
	Watch bool
}

// Result is what a checker prints.
type Result struct {
	Consumer string `json:"consumer"`
	// Server is the API server the consumer's client talks to.
	Server string `json:"server"`
	// Status is the HTTP status of the list: 200, or the API server's
	// refusal (401 for a revoked or expired token).
	Status int `json:"status"`
	// ConfigMaps are the names listed when Status is 200.
	ConfigMaps []string `json:"configMaps,omitempty"`
	// Error is the list's error when Status is not 200.
	Error string `json:"error,omitempty"`
	// Cluster holds what the consumer read besides the credential (Argo
	// CD's project, namespaces, ...), for the test to compare.
	Cluster map[string]any `json:"cluster,omitempty"`
}

// ErrRefused wraps the consumer's own error when its code would not make
// a client of the Secret (exit status 1).
type ErrRefused struct{ Err error }

func (e ErrRefused) Error() string { return "the consumer refused the Secret: " + e.Err.Error() }
func (e ErrRefused) Unwrap() error { return e.Err }

// CommandLine is a's flags as Main parses them, for whoever runs a
// checker (test/e2e): one place for the contract on both sides.
func (a Args) CommandLine() []string {
	args := []string{"--kubeconfig", a.Kubeconfig, "--namespace", a.Namespace, "--name", a.Name, "--list-namespace", a.ListNamespace}
	if a.Key != "" {
		args = append(args, "--key", a.Key)
	}
	if a.ServiceAccount != "" {
		args = append(args, "--service-account", a.ServiceAccount)
	}
	if a.Watch {
		args = append(args, "--watch")
	}
	return args
}

// Main parses the flags, runs check and prints its Result as one JSON
// line; with --watch it runs the checker's watch mode instead.
func Main(consumer string, check func(ctx context.Context, a Args) (*Result, error), opts ...Option) {
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	var a Args
	fs := flag.NewFlagSet(consumer, flag.ContinueOnError)
	fs.StringVar(&a.Kubeconfig, "kubeconfig", "", "kubeconfig of the cluster that holds the Secret (required)")
	fs.StringVar(&a.Namespace, "namespace", "", "namespace of the Secret (required)")
	fs.StringVar(&a.Name, "name", "", "name of the Secret (required)")
	fs.StringVar(&a.Key, "key", "", "data key, where the consumer lets one be chosen")
	fs.StringVar(&a.ListNamespace, "list-namespace", "", "namespace of the target cluster to list ConfigMaps in (required)")
	fs.StringVar(&a.ServiceAccount, "service-account", "", "ServiceAccount to impersonate, where the consumer does")
	fs.BoolVar(&a.Watch, "watch", false, "start the consumer's informer or cache and print a line per event until it loses the cluster (exit 1)")
	if err := fs.Parse(os.Args[1:]); err != nil {
		os.Exit(2)
	}
	if a.Kubeconfig == "" || a.Namespace == "" || a.Name == "" || a.ListNamespace == "" {
		fmt.Fprintln(os.Stderr, "--kubeconfig, --namespace, --name and --list-namespace are required")
		os.Exit(2)
	}
	if a.Watch {
		if o.watch == nil {
			fmt.Fprintf(os.Stderr, "%s has no watch mode\n", consumer)
			os.Exit(2)
		}
		os.Exit(runWatch(consumer, o.watch, a))
	}
	ctx, stop := signalContext()
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	r, err := check(ctx, a)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", consumer, err)
		os.Exit(1)
	}
	r.Consumer = consumer
	_ = json.NewEncoder(os.Stdout).Encode(r)
}

// signalContext ends at SIGINT or SIGTERM.
func signalContext() (context.Context, context.CancelFunc) {
	return signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
}

// SourceClient is a client of the cluster that holds the Secret.
func SourceClient(a Args) (*kubernetes.Clientset, error) {
	cfg, err := clientcmd.BuildConfigFromFlags("", a.Kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("source cluster: %w", err)
	}
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, fmt.Errorf("source cluster: %w", err)
	}
	return c, nil
}

// SourceSecret reads the Secret the arguments name.
func SourceSecret(ctx context.Context, a Args) (*corev1.Secret, error) {
	c, err := SourceClient(a)
	if err != nil {
		return nil, err
	}
	s, err := c.CoreV1().Secrets(a.Namespace).Get(ctx, a.Name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("read the Secret: %w", err)
	}
	return s, nil
}

// ListWith lists ConfigMaps in a.ListNamespace with a client-go client
// made from the consumer's REST config, and returns the Result.
func ListWith(ctx context.Context, cfg *rest.Config, a Args) (*Result, error) {
	c, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return nil, ErrRefused{Err: err}
	}
	list, err := c.CoreV1().ConfigMaps(a.ListNamespace).List(ctx, metav1.ListOptions{})
	r := &Result{Server: cfg.Host}
	if err != nil {
		return r.Failed(err), nil
	}
	for _, cm := range list.Items {
		r.ConfigMaps = append(r.ConfigMaps, cm.Name)
	}
	r.Status = 200
	return r, nil
}

// Failed records a list's error and its HTTP status (0 when it has none,
// as for a connection error).
func (r *Result) Failed(err error) *Result {
	var s apierrors.APIStatus
	if errors.As(err, &s) {
		r.Status = int(s.Status().Code)
	}
	r.Error = err.Error()
	return r
}
