package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"reflect"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"github.com/spf13/viper"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"

	"github.com/tokenbroker/tokenbroker/agent/config"
	"github.com/tokenbroker/tokenbroker/api/schema"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/pki"
)

// The kinds of configuration file "config validate" knows.
const (
	kindAuto   = "auto"
	kindPolicy = "policy"
	kindAgent  = "agent"
	kindServe  = "serve"
)

var configKinds = []string{kindAuto, kindPolicy, kindAgent, kindServe}

// maxConfigFileBytes is the size limit of the policy and agent loaders.
const maxConfigFileBytes = 1 << 20

func newConfigCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "config",
		Short: "Work with tokenbroker configuration files",
	}
	cmd.AddCommand(newConfigValidateCommand())
	return cmd
}

func newConfigValidateCommand() *cobra.Command {
	var kind, kubeconfig, kubeContext string
	cmd := &cobra.Command{
		Use:   "validate FILE... [--kind auto|policy|agent|serve]",
		Short: "Check configuration files and print every problem with its field path",
		Long: `Check configuration files the way the programs that read them do, and print
every problem at once, one per line:

  FILE: field.path: message

Exit status 1 if there is any problem, else "FILE: valid <kind> config" and
exit status 0. Files that cannot be read are errors (exit status 1).

Kinds (--kind auto, the default, tells them apart by their top-level keys):

  policy  the broker's policy file (serve --policy-file, docs/policy.md):
          unknown fields, wrong types and every rule of the policy; a
          cluster.caFile that exists here must be a PEM bundle of
          certificates; one that does not exist here is only noted on
          stderr, since it is read where the broker runs.
  agent   the agent's config file (agent --config, docs/agent.md): unknown
          fields, wrong types and every rule of the agent's loader. A
          target that names audiences is noted on stderr: the broker
          answers 403 unless the grant lists every one (grants[].audiences).
  serve   the YAML file of serve --config, whose keys are serve's flag
          names: unknown keys, values that do not parse as the flag's type,
          and serve's checks of the values given. Required flags the file
          leaves out are not problems: flags or TOKENBROKER_* variables may
          give them.

Field paths are those of the loaders' own messages:
peers[0].grants[1].maxTTL, targets[0].outputs[0].secret.format, gc-interval.

With --kubeconfig (the target cluster, as someone allowed to create
SubjectAccessReviews and read RBAC), a valid policy is also checked for
persistence: every grant whose holder could make a credential that outlives
its lease (create Secrets, ServiceAccount tokens, RoleBindings, pods or
workloads; escalate, bind or impersonate) is warned of on stderr, per
grant, and so is a grant bound to an aggregated ClusterRole (admin, edit,
view), which grows. Warnings do not change the exit status; failing to ask
the API server does (exit status 1). See docs/security.md.`,
		Example: `  tokenbroker config validate deploy/base/policy.yaml
  tokenbroker config validate deploy/agent/agent.yaml
  tokenbroker config validate --kind serve /etc/tokenbroker/broker.yaml

  # in CI, every configuration of an overlay
  tokenbroker config validate overlays/east/policy.yaml overlays/west/agent.yaml

  # and what the grants' holders could keep after revocation, in the target cluster
  tokenbroker config validate --kubeconfig east-admin.kubeconfig deploy/base/policy.yaml`,
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, files []string) error {
			var persistence persistenceCheck
			if kubeconfig != "" || kubeContext != "" {
				rc, err := restConfig(kubeconfig, kubeContext)
				if err != nil {
					return err
				}
				cs, err := kubernetes.NewForConfig(rc)
				if err != nil {
					return fmt.Errorf("Kubernetes client: %w", err)
				}
				clients := policy.PersistenceClients{Reviews: cs.AuthorizationV1().SubjectAccessReviews(), RBAC: cs.RbacV1()}
				persistence = func(p *policy.Policy) ([]apiv1.FieldError, error) {
					return policy.CheckPersistence(cmd.Context(), p, clients)
				}
			}
			return runConfigValidate(files, kind, persistence, cmd.OutOrStdout(), cmd.ErrOrStderr())
		},
		ValidArgsFunction: func(*cobra.Command, []string, string) ([]string, cobra.ShellCompDirective) {
			return []string{"yaml", "yml", "json"}, cobra.ShellCompDirectiveFilterFileExt
		},
	}
	cmd.Flags().StringVar(&kind, "kind", kindAuto, "kind of file: auto, policy, agent or serve")
	cmd.Flags().StringVar(&kubeconfig, "kubeconfig", "", "the target cluster's kubeconfig: also warn of grants whose holders could make credentials that outlive the lease")
	cmd.Flags().StringVar(&kubeContext, "context", "", "the kubeconfig context (with --kubeconfig; default: its current context)")
	_ = cmd.RegisterFlagCompletionFunc("kind", cobra.FixedCompletions(configKinds, cobra.ShellCompDirectiveNoFileComp))
	return cmd
}

// persistenceCheck warns of a valid policy's grants whose holders could
// outlive their leases (broker.CheckPersistence); nil checks nothing.
type persistenceCheck func(*policy.Policy) ([]apiv1.FieldError, error)

// runConfigValidate validates every file, prints its problems to out and
// its notes and warnings to errOut, and fails if any file has a problem,
// cannot be read, or (with persistence) could not be checked.
func runConfigValidate(files []string, kind string, persistence persistenceCheck, out, errOut io.Writer) error {
	valid := false
	for _, k := range configKinds {
		valid = valid || k == kind
	}
	if !valid {
		return fmt.Errorf("--kind must be one of %s, not %q", strings.Join(configKinds, ", "), kind)
	}
	var errs []error
	for _, file := range files {
		res, err := validateConfigFile(file, kind)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, n := range res.Notes {
			fmt.Fprintln(errOut, formatProblem(file, n))
		}
		for _, p := range res.Problems {
			fmt.Fprintln(out, formatProblem(file, p))
		}
		if len(res.Problems) > 0 {
			errs = append(errs, fmt.Errorf("%s: %d %s in this %s config", file, len(res.Problems), plural(len(res.Problems), "problem"), res.Kind))
			continue
		}
		fmt.Fprintf(out, "%s: valid %s config\n", file, res.Kind)
		if persistence != nil && res.Kind == kindPolicy {
			if err := printPersistence(file, persistence, errOut); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// printPersistence prints the persistence warnings of the valid policy
// file, one per line: "FILE: peers[0].grants[1]: warning: …".
func printPersistence(file string, check persistenceCheck, errOut io.Writer) error {
	data, err := pki.ReadFileLimit(file, maxConfigFileBytes)
	if err != nil {
		return fmt.Errorf("read config: %w", err)
	}
	p, err := policy.Parse(data)
	if err != nil {
		return fmt.Errorf("%s: %w", file, err)
	}
	warnings, err := check(p)
	for _, w := range warnings {
		w.Detail = "warning: " + w.Detail
		fmt.Fprintln(errOut, formatProblem(file, w))
	}
	if err != nil {
		return fmt.Errorf("%s: check the grants against the cluster: %w", file, err)
	}
	return nil
}

func formatProblem(file string, p apiv1.FieldError) string {
	if p.Field == "" {
		return file + ": " + p.Detail
	}
	return file + ": " + p.Field + ": " + p.Detail
}

func plural(n int, word string) string {
	if n == 1 {
		return word
	}
	return word + "s"
}

// configKindsChecked are the kinds "config validate" knows, with the keys
// that tell them apart and their owners' checks.
func configKindsChecked() []schema.Kind {
	return []schema.Kind{
		{Name: kindPolicy, Description: "a policy (cluster, ttl, peers)", Keys: schema.FieldNames(reflect.TypeFor[policy.Policy]()), Check: policy.CheckDocument},
		{Name: kindAgent, Description: "an agent config (identity, targets, ...)", Keys: schema.FieldNames(reflect.TypeFor[config.Config]()),
			Check: func(path string, doc any) ([]apiv1.FieldError, []apiv1.FieldError) {
				return config.CheckDocument(path, doc), config.Notes(doc)
			}},
		{Name: kindServe, Description: "a serve config (serve's flag names)", Keys: serveFileKeys(),
			Check: func(path string, _ any) ([]apiv1.FieldError, []apiv1.FieldError) {
				return validateServeConfig(path)
			}},
	}
}

// validateConfigFile reads path and checks it as the given kind (or the
// kind its keys say, for kindAuto).
func validateConfigFile(path, kind string) (schema.Result, error) {
	data, err := pki.ReadFileLimit(path, maxConfigFileBytes)
	if err != nil {
		return schema.Result{}, fmt.Errorf("read config: %w", err)
	}
	if kind == kindAuto {
		kind = ""
	}
	return schema.CheckDocument(path, data, kind, configKindsChecked())
}

// serveRequiredFlags are the flags serve requires; a config file may leave
// them to flags or the environment.
var serveRequiredFlags = []string{"tls-cert-file", "tls-key-file", "client-ca-file", "policy-file"}

// validateServeConfig checks the YAML file of "serve --config": the keys
// and value types as newViper checks them, then serve's own checks of the
// values the file gives. The notes explain refusals that a valid file
// still leads to.
func validateServeConfig(path string) (problems, notes []apiv1.FieldError) {
	fv := viper.New()
	fv.SetConfigFile(path)
	if err := fv.ReadInConfig(); err != nil {
		return []apiv1.FieldError{{Detail: err.Error()}}, nil
	}
	flags := serveFlags()
	problems, clean := schema.FlagFileProblems(flags, fv.AllSettings())
	notes = append(joinTokenNotes(clean), gatewayNotes(clean)...)

	// serve's checks, on the file's values and the defaults only: no
	// environment, and the required flags set to something, since flags
	// or the environment may give them.
	v := viper.New()
	flags.VisitAll(func(f *pflag.Flag) { _ = v.BindPFlag(f.Name, f) })
	if err := v.MergeConfigMap(clean); err != nil {
		return append(problems, apiv1.FieldError{Detail: err.Error()}), notes
	}
	for _, k := range serveRequiredFlags {
		if _, ok := clean[k]; !ok {
			v.Set(k, "given-elsewhere")
		}
	}
	_, err := serveConfigFrom(v)
	for _, e := range unjoin(err) {
		problems = append(problems, flagProblem(e.Error()))
	}
	return problems, notes
}

// joinTokenNotes explains, for a serve file with an enrollment listener,
// which join tokens the broker takes: since audiences, a token must name
// the broker, and one made without "pki join-token --audience" (as every
// older release made them) is refused unless accept-unbound-join-tokens.
func joinTokenNotes(settings map[string]any) []apiv1.FieldError {
	if addr, _ := settings["enroll-address"].(string); addr == "" {
		return nil
	}
	if unbound, _ := settings["accept-unbound-join-tokens"].(bool); unbound {
		return []apiv1.FieldError{{Field: "accept-unbound-join-tokens",
			Detail: "join tokens that name no broker are accepted: a token made for another broker of the same CA without --audience can be used here; remove this once the tokens made before the upgrade are used or expired"}}
	}
	name := "the policy's cluster.name"
	if names, ok := settings["broker-name"].([]any); ok && len(names) > 0 {
		parts := make([]string, 0, len(names))
		for _, n := range names {
			parts = append(parts, fmt.Sprint(n))
		}
		name = strings.Join(parts, " or ")
	}
	return []apiv1.FieldError{{Field: "enroll-address",
		Detail: "join tokens must name this broker: make them with \"pki join-token --audience\" " + name + "; tokens without an audience (made before the upgrade) are refused (401) unless accept-unbound-join-tokens: true"}}
}

// gatewayNotes explains, for a serve file, what keeps the lease gateway
// from forwarding: the Pod flags older charts passed (ignored now), and a
// policy whose gateway grants this broker would answer 422 because it
// runs no gateway.
func gatewayNotes(settings map[string]any) []apiv1.FieldError {
	var notes []apiv1.FieldError
	for _, k := range []string{"gateway-pod-name", "gateway-pod-uid"} {
		if _, ok := settings[k]; ok {
			notes = append(notes, apiv1.FieldError{Field: k,
				Detail: "ignored: the gateway's upstream tokens are bound to each lease Secret (a token bound to the broker's Pod is refused for a ServiceAccount of another namespace); remove it"})
		}
	}
	addr, _ := settings["gateway-address"].(string)
	file, _ := settings["policy-file"].(string)
	if addr != "" || file == "" {
		return notes
	}
	// The policy's own problems are its validation's ("config validate
	// policy.yaml"): only its grants are read here.
	data, err := os.ReadFile(file)
	if err != nil {
		return notes
	}
	var p policy.Policy
	if yaml.Unmarshal(data, &p) != nil {
		return notes
	}
	if n := p.GatewayGrants(); n > 0 {
		notes = append(notes, apiv1.FieldError{Field: "gateway-address",
			Detail: fmt.Sprintf("the policy (%s) has %d %s with access: gateway, but no gateway-address: this broker runs no lease gateway and answers their requests 422", file, n, plural(n, "grant"))})
	}
	return notes
}

// unjoin returns the errors errors.Join joined, or err alone.
func unjoin(err error) []error {
	if err == nil {
		return nil
	}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		var out []error
		for _, e := range j.Unwrap() {
			out = append(out, unjoin(e)...)
		}
		return out
	}
	return []error{err}
}

// flagProblem turns one of serve's messages ("--gc-interval must be at
// least 1s") into a problem of the key it names.
func flagProblem(msg string) apiv1.FieldError {
	rest, ok := strings.CutPrefix(msg, "--")
	if !ok {
		return apiv1.FieldError{Detail: msg}
	}
	end := strings.IndexAny(rest, " :")
	if end < 0 {
		return apiv1.FieldError{Detail: msg}
	}
	name, detail := rest[:end], strings.TrimLeft(rest[end:], " :")
	if strings.HasPrefix(detail, "and ") || detail == "" {
		detail = msg // "--a and --b go together" reads best whole
	}
	return apiv1.FieldError{Field: name, Detail: detail}
}

// serveFileKeys are the keys of a serve --config file: serve's flag names.
func serveFileKeys() []string {
	var keys []string
	serveFlags().VisitAll(func(f *pflag.Flag) {
		if !schema.NotAFileKey(f.Name) {
			keys = append(keys, f.Name)
		}
	})
	return keys
}
