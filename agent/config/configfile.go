package config

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"sigs.k8s.io/yaml"

	"github.com/tokenbroker/tokenbroker/api/schema"
	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/pki"
)

// Defaults of the configuration file, filled in by Config.Default.
const (
	DefaultFraction    = 2.0 / 3.0
	DefaultJitter      = 0.1
	DefaultMinBackoff  = time.Second
	DefaultMaxBackoff  = 5 * time.Minute
	DefaultRevokeGrace = 10 * time.Minute
	DefaultRenewAt     = 0.66
	DefaultOpsAddress  = ":9091"
	// DefaultTrustBundleInterval is how often ClusterTrustBundles are read.
	DefaultTrustBundleInterval = time.Minute
)

// maxConfigBytes bounds the configuration file; a config is small.
const maxConfigBytes = 1 << 20

// Load reads, parses, defaults and validates the configuration file
// at path. Relative paths in it (identity.dir, identity.enroll.tokenFile,
// kubeconfig, file outputs) are taken relative to the file's directory, as
// the broker's policy file does with caFile.
func Load(path string) (Config, error) {
	data, err := pki.ReadFileLimit(path, maxConfigBytes)
	if err != nil {
		return Config{}, fmt.Errorf("read agent config: %w", err)
	}
	cfg, err := Parse(data, filepath.Dir(path))
	if err != nil {
		return Config{}, fmt.Errorf("%s: %w", path, err)
	}
	return cfg, nil
}

// Parse decodes a configuration document (YAML or JSON), resolves
// relative paths against baseDir (empty: leave them as they are), applies
// the defaults and validates it. Unknown fields are errors, so that a
// misspelt key is never silently ignored.
func Parse(data []byte, baseDir string) (Config, error) {
	if len(data) > maxConfigBytes {
		return Config{}, fmt.Errorf("agent config is %d bytes, over the limit of %d", len(data), maxConfigBytes)
	}
	js, err := yaml.YAMLToJSON(data)
	if err != nil {
		return Config{}, fmt.Errorf("parse agent config: %w", err)
	}
	dec := json.NewDecoder(bytes.NewReader(js))
	dec.DisallowUnknownFields()
	var cfg Config
	if err := dec.Decode(&cfg); err != nil {
		return Config{}, fmt.Errorf("parse agent config: %w", err)
	}
	if baseDir != "" {
		cfg.resolvePaths(baseDir)
	}
	cfg.Default()
	if err := cfg.Validate(); err != nil {
		return Config{}, err
	}
	return cfg, nil
}

func (c *Config) resolvePaths(base string) {
	abs := func(p *string) {
		if *p != "" && !filepath.IsAbs(*p) {
			*p = filepath.Join(base, *p)
		}
	}
	abs(&c.Identity.Dir)
	if pc := c.Identity.PodCertificate; pc != nil {
		abs(&pc.Dir)
	}
	abs(&c.Kubeconfig)
	if c.Identity.Enroll != nil {
		abs(&c.Identity.Enroll.TokenFile)
	}
	for i := range c.Targets {
		abs(&c.Targets[i].WorkloadTokenFile)
		for j := range c.Targets[i].Outputs {
			if f := c.Targets[i].Outputs[j].File; f != nil {
				abs(&f.Path)
			}
		}
	}
}

// Default fills in every field left empty with its default. It is
// idempotent; New calls it, so a Config built in Go needs only what it
// means to set. A target's Refresh, when given, is completed from the
// top-level one field by field.
func (c *Config) Default() {
	if u := c.JWKSUpload; u != nil {
		if u.Interval == 0 {
			u.Interval = apiv1.Duration(DefaultJWKSInterval)
		}
		if u.ResyncInterval == 0 {
			u.ResyncInterval = apiv1.Duration(max(DefaultJWKSResyncInterval, time.Duration(u.Interval)))
		}
		if p := u.LivePods; p != nil && p.Interval == 0 {
			p.Interval = apiv1.Duration(DefaultLivePodsInterval)
		}
	}
	c.Refresh.Fill(RefreshConfig{
		Fraction:    DefaultFraction,
		Jitter:      DefaultJitter,
		MinBackoff:  apiv1.Duration(DefaultMinBackoff),
		MaxBackoff:  apiv1.Duration(DefaultMaxBackoff),
		RevokeGrace: apiv1.Duration(DefaultRevokeGrace),
	})
	for i := range c.Targets {
		if c.Targets[i].Refresh != nil {
			c.Targets[i].Refresh.Fill(c.Refresh)
		}
	}
	if tb := c.Identity.TrustBundleFrom; tb != nil && tb.ClusterTrustBundle != nil && tb.ClusterTrustBundle.Interval == 0 {
		tb.ClusterTrustBundle.Interval = apiv1.Duration(DefaultTrustBundleInterval)
	}
	if c.Identity.RenewAt == 0 {
		c.Identity.RenewAt = DefaultRenewAt
	}
	if c.Identity.RenewBroker == "" && len(c.Targets) > 0 && c.Identity.PodCertificate == nil {
		c.Identity.RenewBroker = c.Targets[0].Broker
	}
	if c.OpsAddress == "" {
		c.OpsAddress = DefaultOpsAddress
	}
	if s := c.PodSigner; s != nil && s.MaxLifetime == 0 {
		s.MaxLifetime = apiv1.Duration(DefaultPodCertificateLifetime)
	}
}

func (r *RefreshConfig) Fill(d RefreshConfig) {
	if r.Fraction == 0 {
		r.Fraction = d.Fraction
	}
	if r.Jitter == 0 {
		r.Jitter = d.Jitter
	}
	if r.MinBackoff == 0 {
		r.MinBackoff = d.MinBackoff
	}
	if r.MaxBackoff == 0 {
		r.MaxBackoff = d.MaxBackoff
	}
	if r.RevokeGrace == 0 {
		r.RevokeGrace = d.RevokeGrace
	}
}

// RefreshFor returns the refresh settings in force for target i: its own,
// completed from the top level, or the top level's. Call Default first.
func (c *Config) RefreshFor(i int) RefreshConfig {
	if r := c.Targets[i].Refresh; r != nil {
		return *r
	}
	return c.Refresh
}

// UsesClusterProfiles reports whether a target has a clusterProfile
// output, which needs a dynamic client of the source cluster.
func (c *Config) UsesClusterProfiles() bool {
	for _, t := range c.Targets {
		for _, o := range t.Outputs {
			if o.ClusterProfile != nil {
				return true
			}
		}
	}
	return false
}

// UsesKubernetes reports whether the agent needs a client of the source
// cluster: for a Secret identity, ClusterTrustBundles, a Secret output
// or a clusterProfile output.
func (c *Config) UsesKubernetes() bool {
	if c.Identity.Secret != nil || c.JWKSUpload != nil || c.Identity.TrustBundleFrom != nil || c.PodSigner != nil {
		return true
	}
	for _, t := range c.Targets {
		for _, o := range t.Outputs {
			if o.Secret != nil || o.ClusterProfile != nil {
				return true
			}
		}
	}
	return false
}

// Validate reports every problem of a defaulted configuration at once, as
// an *apiv1.ValidationError.
func (c *Config) Validate() error {
	v := &validator{}
	c.validateIdentity(v)
	v.refresh("refresh", c.Refresh)
	if c.OpsAddress != "" {
		if _, _, err := net.SplitHostPort(c.OpsAddress); err != nil {
			v.add("opsAddress", "must be host:port or :port: %v", err)
		}
	}
	if len(c.Targets) == 0 && c.JWKSUpload == nil && c.PodSigner == nil {
		v.add("targets", "at least one target is required")
	}
	if s := c.PodSigner; s != nil {
		validatePodSigner(v, s)
	}
	if u := c.JWKSUpload; u != nil {
		if len(u.Brokers) == 0 {
			v.add("jwksUpload.brokers", "at least one broker is required")
		}
		if !u.UploadsKeys() && u.LivePods == nil {
			v.add("jwksUpload.keys", "with keys: false only the live Pods are reported: set jwksUpload.livePods")
		}
		for i, b := range u.Brokers {
			v.httpsURL(fmt.Sprintf("jwksUpload.brokers[%d]", i), b, true)
		}
		if d := time.Duration(u.Interval); d != 0 && (d < time.Second || d > time.Hour) {
			v.add("jwksUpload.interval", "must be between 1s and 1h")
		}
		if d := time.Duration(u.ResyncInterval); d != 0 && (d < time.Duration(u.Interval) || d > 24*time.Hour) {
			v.add("jwksUpload.resyncInterval", "must be between jwksUpload.interval and 24h")
		}
		if p := u.LivePods; p != nil {
			if d := time.Duration(p.Interval); d != 0 && (d < time.Second || d > 30*time.Minute) {
				v.add("jwksUpload.livePods.interval", "must be between 1s and 30m (and well under the brokers' livePodsMaxAge)")
			}
			if len(p.Audiences) == 0 && c.PodSigner == nil {
				v.add("jwksUpload.livePods.audiences", "list the brokers' workload audiences: a Pod is reported if it has a projected token for one (or, with podSigner, a podCertificate volume of its signer)")
			}
			if len(p.Audiences) > 16 {
				v.add("jwksUpload.livePods.audiences", "at most 16 audiences")
			}
			if len(p.Namespaces) > 256 {
				v.add("jwksUpload.livePods.namespaces", "at most 256 namespaces")
			}
			for i, ns := range p.Namespaces {
				if msgs := validation.IsDNS1123Label(ns); len(msgs) > 0 {
					v.add(fmt.Sprintf("jwksUpload.livePods.namespaces[%d]", i), "must be a namespace name: %s", strings.Join(msgs, "; "))
				}
			}
			for i, a := range p.Audiences {
				if strings.TrimSpace(a) == "" || len(a) > 256 {
					v.add(fmt.Sprintf("jwksUpload.livePods.audiences[%d]", i), "must be 1 to 256 characters")
				}
			}
		}
	}
	names := map[string]int{}
	secrets := map[string]string{}
	files := map[string]string{}
	profiles := map[string]string{}
	if s := c.Identity.Secret; s != nil {
		secrets[s.Namespace+"/"+s.Name] = "identity.secret"
	}
	for i, t := range c.Targets {
		path := fmt.Sprintf("targets[%d]", i)
		if msgs := validation.IsDNS1123Label(t.Name); t.Name == "" {
			v.add(path+".name", "is required")
		} else if len(msgs) > 0 {
			v.add(path+".name", "must be a DNS label: %s", strings.Join(msgs, "; "))
		} else if j, dup := names[t.Name]; dup {
			v.add(path+".name", "duplicate target name %q (also targets[%d])", t.Name, j)
		} else {
			names[t.Name] = i
		}
		v.httpsURL(path+".broker", t.Broker, true)
		validateRequest(v, path+".request", t.Request)
		if t.WorkloadTokenFile != "" && strings.ContainsRune(t.WorkloadTokenFile, 0) {
			v.add(path+".workloadTokenFile", "must be a file path")
		}
		if t.Refresh != nil {
			v.refresh(path+".refresh", *t.Refresh)
		}
		v.graceFits(path, t.Request, c.RefreshFor(i))
		if len(t.Outputs) == 0 {
			v.add(path+".outputs", "at least one output is required")
		}
		for j, o := range t.Outputs {
			opath := fmt.Sprintf("%s.outputs[%d]", path, j)
			switch {
			case countSet(o.Secret != nil, o.File != nil, o.ClusterProfile != nil) > 1:
				v.add(opath, "give one of secret, file and clusterProfile")
			case o.ClusterProfile != nil:
				cp := o.ClusterProfile
				name := cp.Name
				if name == "" {
					name = t.Name
				}
				v.objectRef(opath+".clusterProfile", ObjectRef{Namespace: cp.Namespace, Name: name})
				if cp.ClusterManager != "" {
					if msgs := validation.IsValidLabelValue(cp.ClusterManager); len(msgs) > 0 {
						v.add(opath+".clusterProfile.clusterManager", "must be a label value (it is the x-k8s.io/cluster-manager label): %s", strings.Join(msgs, "; "))
					}
				}
				key := cp.Namespace + "/" + name
				if prev, dup := profiles[key]; dup {
					v.add(opath+".clusterProfile", "ClusterProfile %s is already written by %s", key, prev)
				} else {
					profiles[key] = opath + ".clusterProfile"
				}
			case o.Secret != nil:
				validateSecretOutput(v, opath+".secret", o.Secret)
				key := o.Secret.Namespace + "/" + o.Secret.Name
				if prev, dup := secrets[key]; dup && o.Secret.Name != "" {
					v.add(opath+".secret", "Secret %s is already written by %s", key, prev)
				} else {
					secrets[key] = opath + ".secret"
				}
			case o.File != nil:
				fpath := opath + ".file.path"
				if o.File.Path == "" {
					v.add(fpath, "is required")
					continue
				}
				if strings.HasSuffix(o.File.Path, "/") {
					v.add(fpath, "must name a file, not a directory")
				}
				// The output writes PATH, PATH.meta and its token file;
				// none may be another output's.
				clean := filepath.Clean(o.File.Path)
				written := map[string]string{clean: fpath, clean + MetaSuffix: fpath + " (its " + MetaSuffix + " file)"}
				if tf := o.File.TokenFile; tf != "" {
					tpath := opath + ".file.tokenFile"
					switch {
					case t.Request.Credential == apiv1.CredentialClientCertificate:
						v.add(tpath, "holds a token, and this target asks for a client certificate: write the kubeconfig itself (no tokenFile)")
					case t.Request.Access == apiv1.AccessGateway:
						v.add(tpath, "holds a token, and this target asks for access gateway, whose credential is a client certificate and key: write the kubeconfig itself (no tokenFile)")
					case tf == "." || tf == ".." || strings.ContainsAny(tf, "/\\\x00"):
						v.add(tpath, "must be a file name beside the kubeconfig, without a directory, not %q", tf)
					default:
						written[filepath.Join(filepath.Dir(clean), tf)] = fpath + " (its token file)"
					}
				}
				dup := false
				for _, key := range slices.Sorted(maps.Keys(written)) {
					if prev, ok := files[key]; ok {
						v.add(fpath, "file %s is already written by %s", key, prev)
						dup = true
						break
					}
				}
				if tf := o.File.TokenFile; tf == filepath.Base(clean) || tf == filepath.Base(clean)+MetaSuffix {
					v.add(opath+".file.tokenFile", "must not be the kubeconfig or its %s file", MetaSuffix)
					dup = true
				}
				if !dup {
					maps.Copy(files, written)
				}
			default:
				v.add(opath, "give secret, file or clusterProfile")
			}
		}
	}
	return v.err()
}

func (c *Config) validateIdentity(v *validator) {
	id := c.Identity
	given := 0
	for _, set := range []bool{id.Dir != "", id.Secret != nil, id.PodCertificate != nil} {
		if set {
			given++
		}
	}
	switch {
	case given > 1:
		v.add("identity", "give one of dir, secret and podCertificate")
	case given == 0:
		v.add("identity", "give dir, secret or podCertificate")
	case id.Secret != nil:
		v.objectRef("identity.secret", *id.Secret)
	case id.PodCertificate != nil:
		c.validatePodCertificateIdentity(v)
	}
	v.httpsURL("identity.renewBroker", id.RenewBroker, false)
	if id.RenewAt <= 0 || id.RenewAt >= 1 {
		v.add("identity.renewAt", "must be between 0 and 1 (exclusive), not %g", id.RenewAt)
	}
	if e := id.Enroll; e != nil {
		v.httpsURL("identity.enroll.broker", e.Broker, true)
		if !validFingerprint(e.CAFingerprint) {
			v.add("identity.enroll.caFingerprint", `must be "sha256:" and 64 hex digits, as "tokenbroker pki join-token" prints it`)
		}
		if e.TokenFile == "" {
			v.add("identity.enroll.tokenFile", "is required")
		}
	}
	if tb := id.TrustBundleFrom; tb != nil {
		ctb := tb.ClusterTrustBundle
		if ctb == nil {
			v.add("identity.trustBundleFrom", "give clusterTrustBundle")
			return
		}
		path := "identity.trustBundleFrom.clusterTrustBundle"
		if ctb.SignerName == "" {
			v.add(path+".signerName", "is required: only bundles linked to a signer are trusted")
		} else if err := pki.ValidSignerName(ctb.SignerName); err != nil {
			v.add(path+".signerName", "%v", err)
		}
		if _, err := metav1.LabelSelectorAsSelector(ctb.LabelSelector); err != nil {
			v.add(path+".labelSelector", "%v", err)
		}
		if d := time.Duration(ctb.Interval); d < time.Second || d > time.Hour {
			v.add(path+".interval", "must be between 1s and 1h")
		}
	}
}

// validatePodCertificateIdentity checks identity.podCertificate and what
// it rules out: the kubelet issues and rotates that identity, so nothing
// enrolls or renews it, and the cluster's signer cannot be the agent that
// waits for it.
func (c *Config) validatePodCertificateIdentity(v *validator) {
	id := c.Identity
	if id.PodCertificate.Dir == "" {
		v.add("identity.podCertificate.dir", "is required: the directory of the Pod's podCertificate volume (tls.crt, tls.key, ca.crt)")
	}
	if id.Enroll != nil {
		v.add("identity.enroll", "must not be set with podCertificate: the kubelet issues the agent's certificate, no join token is used")
	}
	if id.RenewBroker != "" {
		v.add("identity.renewBroker", "must not be set with podCertificate: the kubelet renews the agent's certificate")
	}
	if c.JWKSUpload != nil {
		v.add("jwksUpload", "must not be set with identity.podCertificate: the brokers take the cluster's key set and live Pods from its client certificate (the signer's agent), since whether a pod certificate is honoured depends on them")
	}
	if c.PodSigner != nil {
		v.add("podSigner", "must not be set with identity.podCertificate: the kubelet starts a Pod only once its certificate is signed, so the signer cannot wait for its own; run the signer as an agent of its own with a client certificate (docs/agent.md)")
	}
}

func validFingerprint(s string) bool {
	hexPart, ok := strings.CutPrefix(strings.ToLower(s), "sha256:")
	if !ok || len(hexPart) != 64 {
		return false
	}
	_, err := hex.DecodeString(hexPart)
	return err == nil
}

// Validate checks a request as the agent and "tokenbroker get kubeconfig"
// send it; the broker checks it again.
func (r RequestConfig) Validate() error {
	v := &validator{}
	validateRequest(v, "request", r)
	return v.err()
}

func validateRequest(v *validator, path string, r RequestConfig) {
	// The broker's own rule set, so that the agent never sends a request
	// the broker would refuse as malformed.
	v.probs = append(v.probs, apiv1.FieldErrors(apiv1.ValidateKubeconfigRequest(r.APIRequest(), field.NewPath(path)))...)
}

func validateSecretOutput(v *validator, path string, s *SecretOutput) {
	v.objectRef(path, ObjectRef{Namespace: s.Namespace, Name: s.Name})
	switch s.Format {
	case FormatAdmiralty, FormatArgoCD, FormatFlux, FormatKubeconfig, FormatMultiKueue:
	case "":
		v.add(path+".format", "is required (%s, %s, %s, %s or %s)", FormatAdmiralty, FormatArgoCD, FormatFlux, FormatKubeconfig, FormatMultiKueue)
	default:
		v.add(path+".format", "unknown format %q (%s, %s, %s, %s or %s)", s.Format, FormatAdmiralty, FormatArgoCD, FormatFlux, FormatKubeconfig, FormatMultiKueue)
	}
	if s.Key != "" {
		if s.Format == FormatMultiKueue {
			v.add(path+".key", "the multikueue format has the fixed key kubeconfig, the one Kueue reads")
		}
		if s.Format == FormatArgoCD {
			v.add(path+".key", "the argocd format has fixed keys (name, server, config, and those of argocd:); use the kubeconfig format for a kubeconfig under a key of your own")
		} else if msgs := validation.IsConfigMapKey(s.Key); len(msgs) > 0 {
			v.add(path+".key", "%s", strings.Join(msgs, "; "))
		}
	}
	if a := s.ArgoCD; a != nil {
		if s.Format != FormatArgoCD {
			v.add(path+".argocd", "is only for format argocd, not %q", s.Format)
		}
		validateArgoCD(v, path+".argocd", a)
	}
	// The agent sets these; a configuration may not override them.
	setByFormat := FormatLabels(s.Format)
	for k, val := range s.Labels {
		if msgs := validation.IsQualifiedName(k); len(msgs) > 0 {
			v.add(path+".labels", "key %q: %s", k, strings.Join(msgs, "; "))
		}
		if msgs := validation.IsValidLabelValue(val); len(msgs) > 0 {
			v.add(path+".labels", "value of %q: %s", k, strings.Join(msgs, "; "))
		}
		if _, byFormat := setByFormat[k]; k == LabelManagedBy || byFormat {
			v.add(path+".labels", "%q is set by the agent for format %s", k, s.Format)
		}
	}
	for k := range s.Annotations {
		if msgs := validation.IsQualifiedName(k); len(msgs) > 0 {
			v.add(path+".annotations", "key %q: %s", k, strings.Join(msgs, "; "))
		}
		if slices.Contains(agentAnnotations, k) {
			v.add(path+".annotations", "%q is set by the agent", k)
		}
	}
}

func validateArgoCD(v *validator, path string, a *ArgoCDOptions) {
	if a.Name != "" && strings.TrimSpace(a.Name) != a.Name {
		v.add(path+".name", "must not start or end with white space")
	}
	if a.Project != "" {
		if msgs := validation.IsDNS1123Subdomain(a.Project); len(msgs) > 0 {
			v.add(path+".project", "%s", strings.Join(msgs, "; "))
		}
	}
	seen := map[string]bool{}
	for i, ns := range a.Namespaces {
		if msgs := validation.IsDNS1123Label(ns); len(msgs) > 0 {
			v.add(fmt.Sprintf("%s.namespaces[%d]", path, i), "%s", strings.Join(msgs, "; "))
		} else if seen[ns] {
			v.add(fmt.Sprintf("%s.namespaces[%d]", path, i), "duplicate namespace %q", ns)
		}
		seen[ns] = true
	}
	if a.ClusterResources != nil && *a.ClusterResources && len(a.Namespaces) == 0 {
		v.add(path+".clusterResources", "means something only with namespaces: a cluster without namespaces already manages cluster-scoped resources")
	}
	if a.Shard != nil && *a.Shard < 0 {
		v.add(path+".shard", "must not be negative")
	}
	if e := a.Exec; e != nil {
		for _, f := range []struct{ name, val string }{{"command", e.Command}, {"identityDir", e.IdentityDir}} {
			switch {
			case f.val == "":
				v.add(path+".exec."+f.name, "is required: the path in Argo CD's pods")
			case !filepath.IsAbs(f.val) || filepath.Clean(f.val) != f.val:
				v.add(path+".exec."+f.name, "must be a clean absolute path: Argo CD runs the plugin in a directory of its own, not %q", f.val)
			}
		}
		for _, k := range slices.Sorted(maps.Keys(e.Env)) {
			if msgs := validation.IsEnvVarName(k); len(msgs) > 0 {
				v.add(path+".exec.env", "%q: %s", k, strings.Join(msgs, "; "))
			}
		}
	}
}

// validator collects problems.
type validator struct {
	probs []apiv1.FieldError
}

func (v *validator) add(field, format string, args ...any) {
	v.probs = append(v.probs, apiv1.FieldError{Field: field, Detail: fmt.Sprintf(format, args...)})
}

func (v *validator) err() error {
	if len(v.probs) == 0 {
		return nil
	}
	return &apiv1.ValidationError{Document: "agent config", Problems: v.probs}
}

func (v *validator) httpsURL(field, s string, required bool) {
	if s == "" {
		if required {
			v.add(field, "is required")
		}
		return
	}
	// The policy's rules for cluster.server, so that a URL the broker's
	// side would refuse is refused here too.
	if detail := schema.URLProblem(s, "must be an https://host[:port] URL", "https"); detail != "" {
		v.add(field, "%s", detail)
	}
}

func (v *validator) objectRef(field string, r ObjectRef) {
	if r.Namespace == "" {
		v.add(field+".namespace", "is required")
	} else if msgs := validation.IsDNS1123Label(r.Namespace); len(msgs) > 0 {
		v.add(field+".namespace", "%s", strings.Join(msgs, "; "))
	}
	if r.Name == "" {
		v.add(field+".name", "is required")
	} else if msgs := validation.IsDNS1123Subdomain(r.Name); len(msgs) > 0 {
		v.add(field+".name", "%s", strings.Join(msgs, "; "))
	}
}

func (v *validator) refresh(path string, r RefreshConfig) {
	if r.Fraction <= 0 || r.Fraction >= 1 {
		v.add(path+".fraction", "must be between 0 and 1 (exclusive), not %g", r.Fraction)
	}
	if r.Jitter < 0 || r.Jitter >= 1 {
		v.add(path+".jitter", "must be at least 0 and below 1, not %g", r.Jitter)
	}
	if r.MinBackoff <= 0 {
		v.add(path+".minBackoff", "must be positive")
	}
	if r.MaxBackoff < r.MinBackoff {
		v.add(path+".maxBackoff", "must not be shorter than minBackoff")
	}
	if r.RevokeGrace < 0 {
		v.add(path+".revokeGrace", "must not be negative")
	}
}

// graceFits refuses a revokeGrace that outlives the replaced credential:
// a credential asked for with ttl is replaced after fraction of it, so it
// has ttl×(1−fraction) left, and a grace longer than that promises
// consumers a switch-over time that the credential does not have. Without
// a ttl the broker decides the lifetime; the refresher warns at run time.
func (v *validator) graceFits(target string, req RequestConfig, r RefreshConfig) {
	ttl, err := time.ParseDuration(req.TTL)
	if err != nil || ttl <= 0 || r.Fraction <= 0 || r.Fraction >= 1 {
		return // reported elsewhere, or unknown
	}
	left := time.Duration(float64(ttl) * (1 - r.Fraction)).Round(time.Second)
	if grace := time.Duration(r.RevokeGrace); grace >= left {
		v.add(target+".refresh.revokeGrace", "%s is not shorter than what is left of the credential when it is replaced (request.ttl %s × (1 − fraction %g) = %s): the replaced credential would expire before its grace ends; shorten revokeGrace, lower refresh.fraction or ask for a longer ttl",
			grace, ttl, r.Fraction, left)
	}
}

// countSet is how many of b are true.
func countSet(b ...bool) int {
	n := 0
	for _, x := range b {
		if x {
			n++
		}
	}
	return n
}

// validatePodSigner checks podSigner: a signer name the API accepts for a
// PodCertificateRequest and is not Kubernetes' own, a lifetime it allows.
func validatePodSigner(v *validator, s *PodSignerConfig) {
	domain, path, ok := strings.Cut(s.SignerName, "/")
	switch {
	case s.SignerName == "":
		v.add("podSigner.signerName", "is required, e.g. tokenbroker.io/workloads")
	case !ok || path == "" || len(validation.IsDNS1123Subdomain(domain)) > 0 || len(s.SignerName) > 571:
		v.add("podSigner.signerName", "must be <domain>/<path>, such as tokenbroker.io/workloads")
	case domain == "kubernetes.io" || strings.HasSuffix(domain, ".kubernetes.io"):
		v.add("podSigner.signerName", "kubernetes.io signer names are Kubernetes' own")
	}
	if d := time.Duration(s.MaxLifetime); d != 0 && (d < time.Hour || d > MaxPodCertificateLifetime) {
		v.add("podSigner.maxLifetime", "must be between 1h (the API's minimum) and %s (its maximum)", MaxPodCertificateLifetime)
	}
}
